"""Prompts and checks shared by the engine tests (tests/models) and the server tests
(tests/serve)."""

from __future__ import annotations

from dynalm.runtime.engine.engine import Engine

TEXTS = [
    "The history of the Roman Empire begins with",
    "Photosynthesis is the process by which plants",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "The capital of Japan is",
    "Water boils at a temperature of",
    "My favourite programming language is",
]
SYSTEM = (
    "You are Marlowe, the help-desk assistant of the Northwind Public Library. "
    "The library opens at nine in the morning and closes at eight in the evening on "
    "weekdays; on Saturdays it closes at five and on Sundays it stays closed. Members may "
    "borrow up to twelve items at once: books for three weeks, films and music for one "
    "week, and magazines for one week. Renewals can be made twice online unless another "
    "member has reserved the item. Late returns cost twenty cents a day for adults and "
    "nothing for children. The reading room on the second floor is silent; group study "
    "rooms on the third floor can be booked for two hours a day. Printing costs ten cents "
    "a page in black and white and fifty cents in colour. Library cards are free for "
    "residents of the county and cost thirty dollars a year for everyone else. Lost cards "
    "are replaced for two dollars. The children's section hosts story time every Tuesday "
    "and Thursday at ten. Wireless internet is free; the network name is Northwind-Guest "
    "and needs no password. Answer briefly and politely, in one or two sentences, and "
    "never invent rules that are not listed here. If you do not know, say so and suggest "
    "asking at the front desk. Parking behind the building is free for the first two "
    "hours; bicycles can be locked at the racks by the main entrance. Volunteers who shelve "
    "books on weekends receive a free tote bag at the end of each season."
)


def assert_no_leak(engine: Engine) -> None:
    """Every page is free or held only by the prefix cache; evicting it frees them all."""
    pool, cache = engine.pool, engine.cache
    assert pool.n_pages - pool.n_free == cache.n_pages == cache.evictable_pages
    assert (pool.refcount <= 1).all()
    assert pool.n_free_recent == engine.config.max_num_seqs * (pool.recent > 0)
    engine.reset_prefix_cache()
    assert pool.n_free == pool.n_pages
