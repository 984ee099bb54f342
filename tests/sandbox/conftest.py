"""Fixtures for sandbox tests: a real pool (real namespaces, cgroups and seccomp), never a fake."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=2)) as running:
        await running.warmed()  # tests that pick a worker from the idle ones find them all there
        yield running
