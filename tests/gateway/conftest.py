"""The gateway's test mesh: a tiny chat model behind target + router, the gateway in front, and
the official `openai` client against it (one per module; a module may override `chat_dir`)."""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio

from services.common.models.tiny import build_tiny_model
from services.gateway.app import Gateway, GatewayConfig
from tests.mesh import TOKEN_A, start_mesh


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-chat"), arch="llama", seed=3, chat=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(chat_dir):
    mesh = await start_mesh(chat_dir)
    gateway = Gateway(GatewayConfig(port=0, router_address=mesh.router.address))
    await gateway.start()
    client = openai.AsyncOpenAI(base_url=f"http://{gateway.address}/v1", api_key=TOKEN_A, max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await gateway.stop()
        await mesh.stop()
