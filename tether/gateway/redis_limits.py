"""The limit counters of `limits.py` in Redis, shared by several gateway instances.

Each counter is a sorted set (reservation id by admission time), a hash (id -> amount) and a running
total; one Lua script expires, checks every counter and reserves in all of them, so concurrent instances
can never both take the last room in a window. The callers' clocks must agree (one host, or NTP).
"""

from __future__ import annotations

from typing import Any, cast

import redis.asyncio as aioredis

from tether.gateway.limits import Counter, Refusal

# KEYS: per counter (zset, hash, total). ARGV: now, id, then per counter (limit, window_s, amount).
# Returns {0} when reserved, else {1-based counter index, used, retry_after_s as a string}.
_RESERVE = """
local now = tonumber(ARGV[1])
local id = ARGV[2]
local n = #KEYS / 3
local function expire(z, h, t, window)
  local old = redis.call('ZRANGEBYSCORE', z, '-inf', now - window)
  if #old > 0 then
    local freed = 0
    for _, member in ipairs(old) do
      freed = freed + tonumber(redis.call('HGET', h, member) or '0')
      redis.call('HDEL', h, member)
    end
    redis.call('ZREMRANGEBYSCORE', z, '-inf', now - window)
    redis.call('DECRBY', t, freed)
  end
  return tonumber(redis.call('GET', t) or '0')
end
for i = 1, n do
  local z, h, t = KEYS[3*i-2], KEYS[3*i-1], KEYS[3*i]
  local limit, window, amount = tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1]), tonumber(ARGV[3*i+2])
  local used = expire(z, h, t, window)
  if used + amount > limit then
    local retry = 'inf'
    if amount <= limit then
      retry = '0'
      local freed = 0
      local entries = redis.call('ZRANGE', z, 0, -1, 'WITHSCORES')
      for j = 1, #entries, 2 do
        freed = freed + tonumber(redis.call('HGET', h, entries[j]) or '0')
        if used - freed + amount <= limit then
          retry = tostring(math.max(tonumber(entries[j+1]) + window - now, 0))
          break
        end
      end
    end
    return {i, used, retry}
  end
end
for i = 1, n do
  local z, h, t = KEYS[3*i-2], KEYS[3*i-1], KEYS[3*i]
  local window, amount = tonumber(ARGV[3*i+1]), tonumber(ARGV[3*i+2])
  redis.call('ZADD', z, now, id)
  redis.call('HSET', h, id, amount)
  redis.call('INCRBY', t, amount)
  local ttl = math.ceil(window * 1000) + 60000
  redis.call('PEXPIRE', z, ttl)
  redis.call('PEXPIRE', h, ttl)
  redis.call('PEXPIRE', t, ttl)
end
return {0}
"""

# KEYS: per counter (hash, total). ARGV: id, then per counter the settled amount.
_SETTLE = """
local id = ARGV[1]
for i = 1, #KEYS / 2 do
  local h, t = KEYS[2*i-1], KEYS[2*i]
  local old = redis.call('HGET', h, id)
  if old then
    local new = tonumber(ARGV[i+1])
    redis.call('HSET', h, id, new)
    redis.call('INCRBY', t, new - tonumber(old))
  end
end
return 0
"""

_USED = """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window)
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
for _, member in ipairs(old) do used = used - tonumber(redis.call('HGET', KEYS[2], member) or '0') end
return used
"""


class RedisLimitStore:
    def __init__(self, url: str, prefix: str = "tether:gw:") -> None:
        self.prefix = prefix
        self.client: aioredis.Redis = aioredis.Redis.from_url(url)
        self._reserve = self.client.register_script(_RESERVE)
        self._settle = self.client.register_script(_SETTLE)
        self._used = self.client.register_script(_USED)

    def _keys(self, counter: Counter) -> list[str]:
        base = self.prefix + counter.name
        return [f"{base}:z", f"{base}:h", f"{base}:t"]

    async def reserve(self, reservation_id: str, counters: list[Counter], now: float) -> Refusal | None:
        if not counters:
            return None
        keys: list[str] = []
        args: list[Any] = [repr(now), reservation_id]
        for counter in counters:
            keys += self._keys(counter)
            args += [counter.limit, repr(counter.window_s), counter.amount]
        result = cast(list[Any], await self._reserve(keys=keys, args=args))
        if int(result[0]) == 0:
            return None
        retry = result[2].decode() if isinstance(result[2], bytes) else str(result[2])
        return Refusal(counters[int(result[0]) - 1], int(result[1]), float(retry))

    async def settle(self, reservation_id: str, counters: list[Counter], amounts: dict[str, int]) -> None:
        keys: list[str] = []
        args: list[Any] = [reservation_id]
        for counter in counters:
            if counter.name in amounts:
                keys += self._keys(counter)[1:]
                args.append(amounts[counter.name])
        if keys:
            await self._settle(keys=keys, args=args)

    async def used(self, counter: Counter, now: float) -> int:
        return int(
            cast(int, await self._used(keys=self._keys(counter), args=[repr(now), repr(counter.window_s)]))
        )

    async def delete_prefix(self) -> None:
        """Remove every counter under this store's prefix (tests, and resetting a deployment)."""
        async for key in self.client.scan_iter(match=self.prefix + "*"):
            await self.client.delete(key)

    async def close(self) -> None:
        await self.client.aclose()
