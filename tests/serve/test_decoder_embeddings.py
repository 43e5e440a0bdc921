"""``dynalm serve`` of decoder embedding models over real HTTP: a tiny random qwen3 whose
GGUF says ``qwen3.pooling_type = 3`` (last token), and the same weights without the key
served with ``--pooling last``. The vectors match transformers' last hidden state; requests
sent at once (packed into shared steps) get what each gets alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
from gguf import PoolingType
from serving import server_process

from models import tiny_models

URL = "/v1/embeddings"
TEXTS = [f"text number {i}: " + "word " * (i % 7) for i in range(16)]


def _vectors(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]])


async def _at_once(url: str, model: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        bodies = [{"model": model, "input": t} for t in TEXTS]
        return await asyncio.gather(*(http.post(URL, json=b) for b in bodies))


def test_decoder_embeddings_over_http(tmp_path: Path) -> None:
    spec = tiny_models.SPECS["qwen3"]
    reference = tiny_models.reference_model(spec)
    keyed = tiny_models.write_gguf(
        reference, spec, tmp_path / "qwen3-embed.gguf", pooling_type=PoolingType.LAST
    )
    plain = tiny_models.write_gguf(reference, spec, tmp_path / "qwen3-plain.gguf")
    args = ["-m", "dynalm.cli", "serve", str(keyed), "--port", "0", "--cpu", "--mode", "exact"]
    with (
        server_process(args, tmp_path / "serve.log") as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        alone = np.concatenate(
            [_vectors(http.post(URL, json={"model": "qwen3-embed", "input": t})) for t in TEXTS]
        )
        body = http.post(URL, json={"model": "qwen3-embed", "input": TEXTS}).json()
        ids = [list(t.encode()) for t in TEXTS]  # byte tokens, no merges, no BOS
        assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
        want = tiny_models.reference_embeddings(reference, ids, PoolingType.LAST)
        assert ((alone * want).sum(1)).min() >= 0.99999
        together = np.array([d["embedding"] for d in body["data"]])
        np.testing.assert_allclose(together, alone, atol=1e-6)
        at_once = asyncio.run(_at_once(server.url, "qwen3-embed"))
        np.testing.assert_allclose(np.concatenate([_vectors(r) for r in at_once]), alone, atol=1e-6)
        r = http.post("/v1/completions", json={"model": "qwen3-embed", "prompt": "hi"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "the model 'qwen3-embed' is an embedding model (qwen3); this endpoint needs a "
            "generation model"
        )
        r = http.post("/api/embed", json={"model": "qwen3-embed", "input": TEXTS[:2]})
        assert r.status_code == 200
        np.testing.assert_allclose(r.json()["embeddings"], alone[:2], atol=1e-6)

    args = ["-m", "dynalm.cli", "serve", str(plain), "--port", "0", "--cpu", "--mode", "exact",
            "--pooling", "last"]  # fmt: skip
    with (
        server_process(args, tmp_path / "serve-plain.log") as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        flagged = _vectors(http.post(URL, json={"model": "qwen3-plain", "input": TEXTS}))
        np.testing.assert_allclose(flagged, together, atol=1e-6)
