"""The fake region's conversations, files, batches and vector stores, driven by the official
SDK: each kind's create, lookups and 404, kept per region and emptied by a restart."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from edgeproxy.testing import FakeRegion, answer_text


@pytest.fixture
async def region() -> AsyncIterator[FakeRegion]:
    async with FakeRegion(name="r1") as region:
        yield region


@pytest.fixture
async def other() -> AsyncIterator[FakeRegion]:
    async with FakeRegion(name="r2") as region:
        yield region


def sdk(region: FakeRegion) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=region.url + "/v1", api_key="x", max_retries=0)


async def test_files_batches_and_vector_stores(region: FakeRegion) -> None:
    async with sdk(region) as client:
        file = await client.files.create(file=("in.jsonl", b'{"a": "hello"}\n'), purpose="batch")
        assert file.id.startswith("file-") and file.bytes == 15 and file.filename == "in.jsonl"
        assert await client.files.retrieve(file.id) == file
        assert (await client.files.content(file.id)).content == b'{"a": "hello"}\n'

        batch = await client.batches.create(
            input_file_id=file.id, endpoint="/v1/responses", completion_window="24h"
        )
        assert batch.id.startswith("batch_") and batch.status == "validating"
        assert (await client.batches.retrieve(batch.id)).input_file_id == file.id
        assert (await client.batches.cancel(batch.id)).status == "cancelling"

        store = await client.vector_stores.create(name="notes", file_ids=[file.id])
        assert store.id.startswith("vs_") and store.file_counts.completed == 1
        hits = await client.vector_stores.search(store.id, query="hello")
        assert [hit.file_id for hit in hits.data] == [file.id]
        assert not (await client.vector_stores.search(store.id, query="absent")).data
        added = await client.vector_stores.files.create(vector_store_id=store.id, file_id=file.id)
        assert added.vector_store_id == store.id
        batch_of_files = await client.vector_stores.file_batches.create(
            vector_store_id=store.id, file_ids=[file.id]
        )
        assert batch_of_files.status == "completed"
        assert (await client.vector_stores.delete(store.id)).deleted
        assert (await client.files.delete(file.id)).deleted
    assert region.counters().object_lookup_misses_total == 0


async def test_a_conversation_holds_the_responses_made_in_it(region: FakeRegion) -> None:
    async with sdk(region) as client:
        conversation = await client.conversations.create(
            items=[{"type": "message", "role": "user", "content": "Hello"}]
        )
        assert conversation.id.startswith("conv_")
        first = await client.responses.create(
            model="m", input="Go on", conversation=conversation.id
        )
        said = [{"role": "user", "content": "Hello"}, {"role": "user", "content": "Go on"}]
        assert first.output_text == answer_text(said, region.behavior.tokens)
        # The next turn answers the whole conversation, this response's answer included.
        second = await client.responses.create(
            model="m", input="More", conversation={"id": conversation.id}
        )
        said += [
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "More"},
        ]
        assert second.output_text == answer_text(said, region.behavior.tokens)
        items = await client.conversations.items.list(conversation.id)
        assert len(items.data) == 5
        assert (await client.conversations.delete(conversation.id)).deleted


async def test_each_kind_is_its_regions_alone_and_404s_elsewhere(
    region: FakeRegion, other: FakeRegion
) -> None:
    async with sdk(region) as here, sdk(other) as there:
        file = await here.files.create(file=("f", b"x"), purpose="batch")
        conversation = await here.conversations.create()
        store = await here.vector_stores.create()
        batch = await here.batches.create(
            input_file_id=file.id, endpoint="/v1/responses", completion_window="24h"
        )
        cases = [
            (there.files.retrieve(file.id), f"No such File object: {file.id}", "id"),
            (
                there.conversations.retrieve(conversation.id),
                f"Conversation with id '{conversation.id}' not found.",
                None,
            ),
            (
                there.responses.create(model="m", input="x", conversation=conversation.id),
                f"Conversation with id '{conversation.id}' not found.",
                None,
            ),
            (
                there.vector_stores.retrieve(store.id),
                f"No vector store found with id '{store.id}'.",
                None,
            ),
            (there.batches.retrieve(batch.id), f"No batch found with id '{batch.id}'.", None),
        ]
        for call, message, param in cases:
            with pytest.raises(openai.NotFoundError) as caught:
                await call
            error = caught.value.response.json()["error"]
            assert (error["message"], error["type"], error["param"], error["code"]) == (
                message,
                "invalid_request_error",
                param,
                None,
            )
    assert other.counters().object_lookup_misses_total == len(cases)
    assert set(region.objects["files"]) == {file.id}
    await region.stop()
    await region.restart()
    assert region.objects == {"conversations": {}, "files": {}, "batches": {}, "vector_stores": {}}
