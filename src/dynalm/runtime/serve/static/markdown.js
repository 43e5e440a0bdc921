// A small Markdown renderer for the chat page: fenced code blocks, inline code, headings,
// lists, block quotes, rules, bold, italics and http(s) links. Every character of the
// source is HTML-escaped before any markup is added, so model output can never inject
// HTML. An unclosed fence (an answer still streaming) renders as code up to the end.
"use strict";

function escapeHtml(text) {
  return text
    .replace(/&/g, "&amp;")
    .replace(/</g, "&lt;")
    .replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;")
    .replace(/'/g, "&#39;");
}

function renderInline(text) {
  // code spans first, kept aside so nothing inside them is formatted
  const spans = [];
  let out = escapeHtml(text).replace(/`([^`]+)`/g, (_, code) => {
    spans.push(`<code>${code}</code>`);
    return `\u0000${spans.length - 1}\u0000`;
  });
  out = out
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/__([^_]+)__/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
    .replace(/(^|[^\w_])_([^_\s][^_]*)_(?!\w)/g, "$1<em>$2</em>")
    .replace(
      /\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
      '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>'
    );
  return out.replace(/\u0000(\d+)\u0000/g, (_, i) => spans[Number(i)]);
}

function renderBlocks(text) {
  const html = [];
  let paragraph = [];
  let list = null; // {tag, items}
  const flushParagraph = () => {
    if (paragraph.length) html.push(`<p>${paragraph.map(renderInline).join("<br>")}</p>`);
    paragraph = [];
  };
  const flushList = () => {
    if (list) html.push(`<${list.tag}>${list.items.map((i) => `<li>${renderInline(i)}</li>`).join("")}</${list.tag}>`);
    list = null;
  };
  for (const line of text.split("\n")) {
    let m;
    if (!line.trim()) {
      flushParagraph();
      flushList();
    } else if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
      flushParagraph();
      flushList();
      html.push(`<h${m[1].length}>${renderInline(m[2])}</h${m[1].length}>`);
    } else if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      flushParagraph();
      flushList();
      html.push("<hr>");
    } else if ((m = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line))) {
      flushParagraph();
      const tag = /\d/.test(m[1]) ? "ol" : "ul";
      if (!list || list.tag !== tag) {
        flushList();
        list = { tag, items: [] };
      }
      list.items.push(m[2]);
    } else if ((m = /^>\s?(.*)$/.exec(line))) {
      flushParagraph();
      flushList();
      html.push(`<blockquote>${renderInline(m[1])}</blockquote>`);
    } else if (list && /^\s+\S/.test(line)) {
      list.items[list.items.length - 1] += " " + line.trim();
    } else {
      flushList();
      paragraph.push(line);
    }
  }
  flushParagraph();
  flushList();
  return html.join("");
}

function renderMarkdown(source) {
  const parts = [];
  const fence = /^```[ \t]*([\w+#.-]*)[^\n]*\n([\s\S]*?)(?:^```[ \t]*$|(?![\s\S]))/gm;
  let last = 0;
  let m;
  while ((m = fence.exec(source)) !== null) {
    parts.push(renderBlocks(source.slice(last, m.index)));
    const lang = m[1] ? ` class="language-${escapeHtml(m[1])}"` : "";
    parts.push(`<pre><code${lang}>${escapeHtml(m[2].replace(/\n$/, ""))}</code></pre>`);
    last = fence.lastIndex;
  }
  parts.push(renderBlocks(source.slice(last)));
  return parts.join("");
}

window.renderMarkdown = renderMarkdown;
