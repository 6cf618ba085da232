"""Conversations end to end on the real model: the Agents SDK's OpenAIConversationsSession keeps an agent's turns in
/v1/conversations, and responses.create continues a conversation with `conversation`."""

from __future__ import annotations

import asyncio

import openai
import pytest

from .helpers import MODEL

pytestmark = pytest.mark.e2e


def test_the_agents_sdk_keeps_its_session_in_a_conversation(base_url):
    from agents import Agent, ModelSettings, Runner, set_default_openai_client, set_tracing_disabled
    from agents.memory import OpenAIConversationsSession

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    set_default_openai_client(client)
    agent = Agent(name="helper", model=MODEL, model_settings=ModelSettings(temperature=0, max_tokens=16))

    async def two_turns() -> tuple[list[dict], str]:
        session = OpenAIConversationsSession(openai_client=client)
        await Runner.run(agent, "My name is Ada.", session=session)
        await Runner.run(agent, "What is my name?", session=session)
        items = await session.get_items()
        conversation = await session._get_session_id()
        await session.clear_session()
        await client.close()  # its connections, before asyncio.run closes their loop
        return items, conversation

    items, conversation = asyncio.run(two_turns())
    said = [i for i in items if i.get("type") == "message"]
    assert [m["role"] for m in said] == ["user", "assistant", "user", "assistant"]
    assert said[0]["content"][0]["text"] == "My name is Ada." and said[2]["content"][0]["text"] == "What is my name?"
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as sync:
        with pytest.raises(openai.NotFoundError):  # cleared: deleted on the server
            sync.conversations.retrieve(conversation)


def test_a_response_continues_a_conversation(client):
    made = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Remember: blue."}])
    first = client.responses.create(model=MODEL, input="What did I ask you to remember?", conversation=made.id,
                                    max_output_tokens=16, temperature=0)
    assert first.conversation is not None and first.conversation.id == made.id
    # the answer read the conversation: its prompt holds the earlier message as well
    alone = client.responses.create(model=MODEL, input="What did I ask you to remember?", max_output_tokens=16,
                                    temperature=0, store=False)
    assert first.usage is not None and alone.usage is not None
    assert first.usage.input_tokens > alone.usage.input_tokens
    kept = list(client.conversations.items.list(made.id, order="asc"))
    assert [(i.type, i.role) for i in kept] == [("message", "user"), ("message", "user"), ("message", "assistant")]
    client.conversations.delete(made.id)
