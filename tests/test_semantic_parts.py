"""The semantic cache's parts on their own: the verifier's rules, the index (scopes,
eviction, removal), the static embedder offline, and the dialects' last questions."""

from __future__ import annotations

import numpy as np
import pytest

from edgeproxy._cache.semantic_index import SemanticIndex
from edgeproxy._cache.semantic_verify import differences
from edgeproxy._protocol.dialects import CHAT, MESSAGES, RESPONSES

# -- the verifier --------------------------------------------------------------------------

SAME = [
    ("How do I enable two-factor authentication?", "How can I turn on two-factor authentication?"),
    ("What is 15% of 200?", "Calculate fifteen percent of 200."),
    ("How do I reverse a list in Python?", "What's the way to reverse a Python list?"),
    ("How do I reverse a list in Python?", "How can I reverse a list in Python?"),
    ("What causes inflation?", "Why does inflation happen?"),
    ("What is the difference between TCP and UDP?", "How does TCP differ from UDP?"),
    ("What does HTTP stand for?", "What is the meaning of HTTP?"),
    ("List the planets of our solar system.", "What are the planets in our solar system?"),
    ("How do I fix a leaking faucet?", "How can I repair a leaking faucet?"),
    ("Explain REST APIs.", "What is a REST API?"),
    ("How do I set up a virtualenv?", "Steps to setup a virtualenv"),
]
# The price of a rule that does not depend on having seen a word: a paraphrase that
# trades a content word for one outside the synonym table is a miss (one upstream call).
MISSED = [
    ("What's the capital of Austria?", "Which city is the capital of Austria?"),
    ("Translate 'good morning' into French", "How do you say 'good morning' in French?"),
]
DIFFERENT = [
    (
        "How do I enable two-factor authentication?",
        "How do I disable two-factor authentication?",
        "word:",
    ),
    ("Sort the names in ascending order", "Sort the names in descending order", "word:"),
    ("What is 15% of 200?", "What is 15% of 300?", "number"),
    ("Convert 5 km to miles", "Convert 5 miles to km", "number"),
    ("What is the capital of Austria?", "What is the capital of Australia?", "word:"),
    ("Where is my order A-10293?", "Where is my order A-10294?", "word:"),
    ("Email alice@example.com the report", "Email bob@example.com the report", "word:"),
    ("Translate 'thank you' into French", "Translate 'thank you' into German", "word:"),
    ("Is it safe to eat raw eggs?", "Isn't it safe to eat raw eggs?", "negation"),
    ("Summarise this in one sentence", "Summarise this in one paragraph", "word:"),
    ("Give me 3 bullet points on Rust", "Give me 5 bullet points on Rust", "number"),
    ("What does the function parse_header do?", "What does the function parse_body do?", "word:"),
    ("How do I migrate MySQL to PostgreSQL?", "How do I migrate PostgreSQL to MySQL?", "role:"),
    ("Draw a dog chases cat cartoon", "Draw a cat chases dog cartoon", "order"),
    ("Log in to the admin panel", "Log out of the admin panel", "word:"),
]


# Near misses of the kinds users met (issue pairs first, then more of each kind): two
# terms of one kind, a reversal with every word the same, a quantity, a lower-case name.
NEAR_MISSES = [
    ("What is a Kubernetes liveness probe?", "What is a Kubernetes readiness probe?"),
    ("When should I use git rebase?", "When should I use git merge?"),
    (
        "What is the maximum daily dose of ibuprofen for an adult?",
        "What is the maximum daily dose of acetaminophen for an adult?",
    ),
    ("Is warfarin safe during pregnancy?", "Is heparin safe during pregnancy?"),
    ("What is the boiling point of ethanol?", "What is the freezing point of ethanol?"),
    ("How long can raw chicken stay in the fridge?", "How long can raw salmon stay in the fridge?"),
    ("How many calories are in two eggs?", "How many calories are in two dozen eggs?"),
    ("How do I migrate MySQL to PostgreSQL?", "How do I migrate PostgreSQL to MySQL?"),
    (
        "Write an email from a manager to an employee about a delay",
        "Write an email from an employee to a manager about a delay",
    ),
    ("Draw a dog chases cat cartoon", "Draw a cat chases dog cartoon"),
    ("Explain TCP slow start", "Explain TCP fast retransmit"),
    (
        "Give me a recipe for vegan chocolate cake",
        "Give me a recipe for gluten-free chocolate cake",
    ),
    ("Is Python good for web scraping?", "Is JavaScript good for web scraping?"),
    ("Summarize the plot of Hamlet", "Summarize the plot of Macbeth"),
    ("What is metformin used for?", "What is metoprolol used for?"),
    ("What caused World War 1?", "What caused World War 2?"),
    # twenty more of the same kind
    (
        "How do I configure nginx as a reverse proxy?",
        "How do I configure haproxy as a reverse proxy?",
    ),
    ("What are the side effects of lisinopril?", "What are the side effects of losartan?"),
    ("How long should I bake a sweet potato?", "How long should I bake a russet potato?"),
    ("What is the keto diet?", "What is the paleo diet?"),
    ("Explain quicksort", "Explain mergesort"),
    ("What are the symptoms of measles?", "What are the symptoms of mumps?"),
    ("How do I convert euros to dollars?", "How do I convert dollars to euros?"),
    ("Is Lisbon cheaper than Porto?", "Is Porto cheaper than Lisbon?"),
    (
        "What is the capital gains tax rate in germany?",
        "What is the capital gains tax rate in austria?",
    ),
    ("How do I pin a dependency with pip?", "How do I pin a dependency with poetry?"),
    (
        "How do I send a file from my laptop to my phone?",
        "How do I send a file from my phone to my laptop?",
    ),
    (
        "What is the difference between a roth ira and a traditional ira?",
        "What is the difference between a roth ira and a 401k?",
    ),
    ("How many players are on a rugby union team?", "How many players are on a rugby league team?"),
    ("What does an alternator do?", "What does a starter motor do?"),
    ("How do I replace a kitchen faucet?", "How do I replace a bathroom faucet?"),
    ("What is the half-life of carbon-14?", "What is the half-life of uranium-238?"),
    ("Translate good morning into Italian", "Translate good morning into Portuguese"),
    ("How do I make cold brew coffee?", "How do I make iced coffee?"),
    ("What is UDP used for?", "What is QUIC used for?"),
    (
        "The lawyer sued the company; what happens next?",
        "The company sued the lawyer; what happens next?",
    ),
]


@pytest.mark.parametrize(("a", "b"), NEAR_MISSES)
def test_near_misses_users_met_are_never_served(a: str, b: str) -> None:
    assert differences(a, b) and differences(b, a)


@pytest.mark.parametrize(("a", "b"), MISSED)
def test_paraphrases_with_words_outside_the_table_are_missed(a: str, b: str) -> None:
    assert differences(a, b) and differences(b, a)


@pytest.mark.parametrize(("a", "b"), SAME)
def test_paraphrases_pass(a: str, b: str) -> None:
    assert differences(a, b) == []
    assert differences(b, a) == []


@pytest.mark.parametrize(("a", "b", "reason"), DIFFERENT)
def test_near_misses_are_caught_both_ways(a: str, b: str, reason: str) -> None:
    assert any(r.startswith(reason) for r in differences(a, b)), differences(a, b)
    assert differences(b, a)


# -- the index -----------------------------------------------------------------------------


def unit(*values: float) -> np.ndarray:
    v = np.array(values, dtype=np.float32)
    return v / np.linalg.norm(v)


def test_the_index_searches_one_scope_only() -> None:
    index = SemanticIndex(2)
    index.add("a", "k1", unit(1, 0))
    index.add("b", "k2", unit(1, 0))
    index.add("a", "k3", unit(0, 1))
    found = index.search("a", unit(1, 0.1), k=2)
    assert [key for key, _ in found] == ["k1", "k3"]
    assert found[0][1] > 0.99
    assert index.search("c", unit(1, 0)) == []


def test_the_index_removes_compacts_and_evicts_the_oldest() -> None:
    index = SemanticIndex(2, max_entries=3)
    for i in range(3):
        assert index.add("s", f"k{i}", unit(1, i)) == []
    assert index.add("s", "k3", unit(1, 3)) == ["k0"]
    index.remove("k1")
    index.remove("k2")
    assert [key for key, _ in index.search("s", unit(1, 3), k=4)] == ["k3"]
    assert len(index) == 1
    index.remove("k3")
    assert index.search("s", unit(1, 0)) == [] and len(index) == 0


def test_a_large_scope_moves_into_a_graph_and_still_finds_its_nearest() -> None:
    pytest.importorskip("usearch", reason="usearch is not installed")
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((300, 32)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    index = SemanticIndex(32, max_entries=250, graph_from=64)
    evicted = []
    for i, row in enumerate(rows):
        evicted += index.add("big", f"k{i}", row)
        index.add("small", f"s{i % 3}", row)
    assert index.graphs() == 1
    # The oldest went first, across both kinds of scope.
    assert "k0" in evicted and len(index) == 250
    assert index.search("big", rows[299], k=1)[0][0] == "k299"
    assert index.search("big", rows[299], k=1)[0][1] > 0.99
    index.remove("k299")
    assert all(key != "k299" for key, _ in index.search("big", rows[299], k=4))
    assert [key for key, _ in index.search("small", rows[299], k=1)] == ["s2"]


def test_redis_vector_search_replies_are_read_as_key_similarity_question() -> None:
    from edgeproxy._cache.semantic_share import parse_search

    reply = [
        2,
        b"p:t1:abc~q",
        [b"k", b"t1:abc", b"q", b"How do I enable 2FA?", b"d", b"0.0421"],
        b"p:t1:def~q",
        [b"d", b"0.2", b"k", b"t1:def", b"q", b"Wie aktiviere ich 2FA?"],
        b"p:bad~q",
        [b"k", b"x"],
    ]
    assert parse_search(reply) == [
        ("t1:abc", pytest.approx(0.9579), "How do I enable 2FA?"),
        ("t1:def", pytest.approx(0.8), "Wie aktiviere ich 2FA?"),
    ]
    assert parse_search(b"garbage") == []


# -- the static embedder -------------------------------------------------------------------


async def test_the_static_embedder_loads_offline_and_sees_paraphrases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("wordllama", reason="the semantic extra (wordllama) is not installed")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from edgeproxy._cache.semantic_embed import StaticEmbedder

    embedder = StaticEmbedder()
    rows = await embedder.embed(
        [
            "How do I reverse a list in Python?",
            "What's the way to reverse a Python list?",
            "What is the weather in Lisbon tomorrow?",
        ]
    )
    assert rows.shape == (3, embedder.dimensions) and rows.dtype == np.float32
    assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-4)
    assert rows[0] @ rows[1] > rows[0] @ rows[2] + 0.3


# -- the dialects' last question -----------------------------------------------------------


def test_the_last_question_and_the_rest_of_the_body() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi there"}]},
        ],
    }
    text, rest = CHAT.last_question(body) or ("", {})
    assert text == "Hi there"
    assert rest["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user"}]
    assert MESSAGES.last_question({"messages": [{"role": "user", "content": "Hello"}]})
    assert RESPONSES.last_question({"input": "Hello"}) == ("Hello", {"input": None})
    # Not a user's text: no semantic lookup.
    assert CHAT.last_question({"messages": [{"role": "assistant", "content": "x"}]}) is None
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    assert CHAT.last_question({"messages": [{"role": "user", "content": image}]}) is None


# -- Redis's vector search ---------------------------------------------------------------------


class _SearchingRedis:
    """Stands in for a Redis server with vector search: records the commands, answers
    FT.SEARCH with ``reply`` (or fails with ``error``)."""

    def __init__(self, reply: object = None, error: Exception | None = None) -> None:
        self.commands: list[tuple[object, ...]] = []
        self.reply = reply
        self.error = error

    async def execute_command(self, *args: object) -> object:
        self.commands.append(args)
        if args[0] == "FT.SEARCH" and self.error is not None:
            raise self.error
        return self.reply if args[0] == "FT.SEARCH" else "OK"

    def pipeline(self, transaction: bool = False) -> _SearchingRedis:
        return self

    def hset(self, *args: object, **kwargs: object) -> None:
        self.commands.append(("HSET", *args))

    def pexpire(self, *args: object) -> None:
        self.commands.append(("PEXPIRE", *args))

    def zadd(self, *args: object) -> None:
        self.commands.append(("ZADD", *args))

    def zremrangebyrank(self, *args: object) -> None:
        self.commands.append(("ZREMRANGEBYRANK", *args))

    async def execute(self) -> list[object]:
        return []


async def test_where_redis_searches_vectors_the_scope_and_embedder_filter_the_knn_query() -> None:
    from edgeproxy._cache.backends import RedisTier
    from edgeproxy._cache.keys import hash_key
    from edgeproxy._cache.semantic_share import SharedQuestions
    from edgeproxy._core.config import config_from_mapping

    config = config_from_mapping(
        {"regions": [{"name": "r", "url": "http://127.0.0.1:1"}], "cache": {"key_prefix": "p:"}}
    )
    tier = RedisTier(config.cache)
    fake = _SearchingRedis(reply=[1, b"p:k1~q", [b"k", b"k1", b"q", b"Why?", b"d", b"0.1"]])
    real, tier.client = tier.client, fake  # type: ignore[assignment]
    try:
        shared = SharedQuestions(tier, "model-a", max_entries=10, interval=1.0, redis_search=True)
        assert await shared.detect() is True
        vector = unit(1, 2)
        await shared.publish("k1", "t1:sem:abc", "Why?", vector, ttl=60.0)
        create = next(c for c in fake.commands if c[0] == "FT.CREATE")
        assert create[1] == "p:~semantic-2" and "DIM" in create and "COSINE" in create
        found = await shared.search("t1:sem:abc", vector, 4)
        assert found == [("k1", pytest.approx(0.9), "Why?")]
        query = next(c for c in fake.commands if c[0] == "FT.SEARCH")
        assert f"@s:{{{hash_key('t1:sem:abc')}}}" in str(query[2])
        assert f"@e:{{{hash_key('model-a')}}}" in str(query[2])
        assert query[query.index("b") + 1] == vector.astype(np.float32).tobytes()
        # A search that fails leaves the lookup to the worker's own index.
        fake.error = ConnectionError("gone")
        assert await shared.search("t1:sem:abc", vector, 4) is None
    finally:
        await real.aclose()


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cache", "message"),
    [
        ({"semantic_embedder": "gguf"}, "semantic_embedder 'gguf' needs semantic_embedder_model"),
        (
            {"semantic_embedder": "region", "semantic_embedder_model": "e"},
            "semantic_embedder 'region' needs semantic_embedder_region",
        ),
        (
            {
                "semantic_embedder": "region",
                "semantic_embedder_region": "nowhere",
                "semantic_embedder_model": "e",
            },
            "cache.semantic_embedder_region: unknown region 'nowhere'",
        ),
        ({"semantic_embedder": "bert"}, "cache.semantic_embedder"),
    ],
)
def test_an_embedder_without_what_it_needs_is_a_config_error(
    cache: dict[str, str], message: str
) -> None:
    from edgeproxy import ConfigError
    from edgeproxy._core.config import config_from_mapping

    with pytest.raises(ConfigError, match=message):
        config_from_mapping(
            {"regions": [{"name": "r", "url": "http://127.0.0.1:1"}], "cache": cache}
        )
