"""The shared prefix index: Redis, so router replicas see one view of every worker's blocks.

Every operation is one Lua script run with EVALSHA: one round trip, atomic, and only the
answer comes back (`match` walks the prompt's chain inside Redis and returns
[worker, blocks, worker, blocks, ...]). Scripts are loaded when the index is built; after a
Redis restart redis-py reloads them once on NOSCRIPT.

Keys, all under the namespace's hash tag `{namespace}:` (one cluster slot; deployments and
models sharing a Redis pick different namespaces):
    b:<hash hex>   SET of worker ids holding the block
    w:<worker id>  SET of block hashes (hex) the worker holds, for remove_worker
    lru            ZSET block hash -> last touch time, for max_blocks and ttl_s
    workers        SET of workers holding at least one block
    stats          HASH of counters
    generation     STRING: set by the first client to find it missing; a new one means Redis lost the index
The bounds are enforced by the scripts exactly as in `base` (no Redis key TTLs, which could
not keep the sets above consistent). Expiry sweeps at most `EXPIRE_BATCH` entries per call,
so a mass expiry never stalls Redis; `match` also treats an expired entry it meets as absent.
Touch times come from the caller's clock (wall time): router replicas must be NTP-synced,
and a skew of a few ms only blurs LRU order between near-simultaneous touches.
"""
from __future__ import annotations

import time
import uuid

import redis

from .base import DEFAULT_MAX_BLOCKS, Clock, IndexStats, PrefixIndex, check_block_hashes

EXPIRE_BATCH = 1024
# Within one event or match, block i counts as touched TOUCH_STEP s earlier than block i-1
# (parents most recent), the in-memory backend's order; 1 us is 4 ulps of time.time().
TOUCH_STEP = 1e-6

_PRELUDE = """
local lru = KEYS[1]
local prefix = ARGV[1]
local now = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])

local function release(w, h)
  local wkey = prefix .. 'w:' .. w
  redis.call('SREM', wkey, h)
  if redis.call('SCARD', wkey) == 0 then redis.call('SREM', prefix .. 'workers', w) end
end

local function drop_block(h)
  local bkey = prefix .. 'b:' .. h
  local holders = redis.call('SMEMBERS', bkey)
  for _, w in ipairs(holders) do release(w, h) end
  redis.call('DEL', bkey)
  redis.call('ZREM', lru, h)
  if #holders > 0 then redis.call('HINCRBY', prefix .. 'stats', 'block_workers', -#holders) end
end

local function forget(w, h)
  local bkey = prefix .. 'b:' .. h
  if redis.call('SREM', bkey, w) == 1 then
    redis.call('HINCRBY', prefix .. 'stats', 'block_workers', -1)
    release(w, h)
    if redis.call('SCARD', bkey) == 0 then redis.call('ZREM', lru, h) end
  end
end

local function expire()
  if ttl <= 0 then return end
  local old = redis.call('ZRANGEBYSCORE', lru, '-inf', now - ttl, 'LIMIT', 0, %(batch)d)
  for _, h in ipairs(old) do drop_block(h) end
  if #old > 0 then redis.call('HINCRBY', prefix .. 'stats', 'expirations', #old) end
end
""" % {"batch": EXPIRE_BATCH}

# ARGV: prefix, now, ttl, worker, max_blocks, n_stored, stored hashes..., evicted hashes...
_APPLY = _PRELUDE + """
expire()
local w = ARGV[4]
local max_blocks = tonumber(ARGV[5])
local n_stored = tonumber(ARGV[6])
local added = 0
for i = 1, n_stored do
  local h = ARGV[6 + i]
  if redis.call('SADD', prefix .. 'b:' .. h, w) == 1 then
    added = added + 1
    redis.call('SADD', prefix .. 'w:' .. w, h)
  end
  redis.call('ZADD', lru, now - (i - 1) * %(step).17g, h)
end
if added > 0 then
  redis.call('SADD', prefix .. 'workers', w)
  redis.call('HINCRBY', prefix .. 'stats', 'block_workers', added)
end
for i = 7 + n_stored, #ARGV do forget(w, ARGV[i]) end
local over = redis.call('ZCARD', lru) - max_blocks
if over > 0 then
  local victims = redis.call('ZPOPMIN', lru, over)
  for i = 1, #victims, 2 do drop_block(victims[i]) end
  redis.call('HINCRBY', prefix .. 'stats', 'capacity_evictions', over)
end
""" % {"step": TOUCH_STEP}

# ARGV: prefix, now, ttl, hashes... -> {worker, matched blocks, ...}
_MATCH = _PRELUDE + """
expire()
local active = nil
local depth = 0
local result = {}
for i = 4, #ARGV do
  local h = ARGV[i]
  local holders = redis.call('SMEMBERS', prefix .. 'b:' .. h)
  if #holders == 0 then break end
  if ttl > 0 then
    local touched_at = redis.call('ZSCORE', lru, h)
    if touched_at and tonumber(touched_at) <= now - ttl then break end
  end
  if active == nil then
    active = {}
    for _, w in ipairs(holders) do active[w] = true end
  else
    local still = {}
    local any = false
    for _, w in ipairs(holders) do
      if active[w] then still[w] = true; any = true end
    end
    for w, _ in pairs(active) do
      if not still[w] then table.insert(result, w); table.insert(result, depth) end
    end
    active = still
    if not any then break end
  end
  depth = depth + 1
end
for w, _ in pairs(active or {}) do table.insert(result, w); table.insert(result, depth) end
local touches = {}
for i = 1, depth do
  table.insert(touches, now - (i - 1) * %(step).17g)
  table.insert(touches, ARGV[3 + i])
  if #touches >= 512 or i == depth then  -- one ZADD per 256 blocks, within unpack's limit
    redis.call('ZADD', lru, 'XX', unpack(touches))
    touches = {}
  end
end
return result
""" % {"step": TOUCH_STEP}

# ARGV: prefix, now, ttl, worker
_REMOVE_WORKER = _PRELUDE + """
local w = ARGV[4]
for _, h in ipairs(redis.call('SMEMBERS', prefix .. 'w:' .. w)) do forget(w, h) end
"""

# ARGV: prefix, now, ttl -> {workers}, blocks, block_workers, capacity_evictions, expirations
_READ = _PRELUDE + """
expire()
local counters = redis.call('HMGET', prefix .. 'stats', 'block_workers', 'capacity_evictions', 'expirations')
return {redis.call('SMEMBERS', prefix .. 'workers'), redis.call('ZCARD', lru),
        tonumber(counters[1]) or 0, tonumber(counters[2]) or 0, tonumber(counters[3]) or 0}
"""


def _hex(h: int) -> str:
    return format(h, "016x")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisPrefixIndex(PrefixIndex):
    """A client of the index kept in Redis; many instances (router replicas, event
    consumers) may share one namespace."""

    def __init__(self, client: redis.Redis, namespace: str = "baton",
                 max_blocks: int = DEFAULT_MAX_BLOCKS, ttl_s: float | None = None,
                 clock: Clock = time.time):
        super().__init__(max_blocks, ttl_s, clock)
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must be non-empty without braces, got {namespace!r}")
        self.namespace = namespace
        self._client = client
        self._owns_client = False
        self._prefix = "{%s}:" % namespace
        self._lru_key = self._prefix + "lru"
        self._apply_script = client.register_script(_APPLY)
        self._match_script = client.register_script(_MATCH)
        self._remove_script = client.register_script(_REMOVE_WORKER)
        self._read_script = client.register_script(_READ)
        for script in (self._apply_script, self._match_script, self._remove_script, self._read_script):
            client.script_load(script.script)  # so the first call is already one round trip

    @classmethod
    def from_url(cls, url: str, password: str | None = None, **kwargs) -> RedisPrefixIndex:
        """password, where given, wins over one in the URL (a Secret need not be URL-escaped)."""
        extra = {"password": password} if password else {}
        index = cls(redis.Redis.from_url(url, decode_responses=True, **extra), **kwargs)
        index._owns_client = True
        return index

    def _head(self) -> list:
        return [self._prefix, repr(self._now()), repr(self.ttl_s or 0.0)]

    def _apply_event(self, worker_id: str, stored: list[int], evicted: list[int]) -> None:
        args = self._head() + [worker_id, self.max_blocks, len(stored)]
        args += [_hex(h) for h in stored] + [_hex(h) for h in evicted]
        self._apply_script(keys=[self._lru_key], args=args)

    def _match(self, hashes: list[int]) -> dict[str, int]:
        reply = self._match_script(keys=[self._lru_key], args=self._head() + [_hex(h) for h in hashes])
        return self._parse_match(reply)

    def match_many(self, prompts) -> list[dict[str, int]]:
        # One round trip for the whole batch: a pipeline of EVALSHA calls.
        batch = [[_hex(h) for h in check_block_hashes(hashes, "block_hashes")] for hashes in prompts]
        if not any(batch):
            return [{} for _ in batch]
        try:
            replies = iter(self._pipelined_matches(batch))
        except redis.exceptions.NoScriptError:  # Redis restarted or SCRIPT FLUSH: reload once
            self._client.script_load(self._match_script.script)
            replies = iter(self._pipelined_matches(batch))
        return [self._parse_match(next(replies)) if hexes else {} for hexes in batch]

    def _pipelined_matches(self, batch: list[list[str]]) -> list:
        pipe = self._client.pipeline(transaction=False)
        for hexes in batch:
            if hexes:  # evalsha directly: a Script on a pipeline costs an extra SCRIPT EXISTS
                pipe.evalsha(self._match_script.sha, 1, self._lru_key, *self._head(), *hexes)
        return pipe.execute()

    def _remove_worker(self, worker_id: str) -> None:
        self._remove_script(keys=[self._lru_key], args=self._head() + [worker_id])

    def generation(self) -> str:
        key = self._prefix + "generation"
        self._client.set(key, uuid.uuid4().hex, nx=True)  # a Redis that restarted empty gets a new one
        return _text(self._client.get(key))

    def workers(self) -> set[str]:
        return {_text(w) for w in self._read()[0]}

    def stats(self) -> IndexStats:
        workers, blocks, block_workers, capacity_evictions, expirations = self._read()
        return IndexStats(blocks=blocks, block_workers=block_workers, workers=len(workers),
                          max_blocks=self.max_blocks, capacity_evictions=capacity_evictions,
                          expirations=expirations)

    def close(self) -> None:
        if self._owns_client:  # a client passed in belongs to the caller
            self._client.close()

    def _read(self) -> list:
        return self._read_script(keys=[self._lru_key], args=self._head())

    @staticmethod
    def _parse_match(reply: list) -> dict[str, int]:
        return {_text(reply[i]): int(reply[i + 1]) for i in range(0, len(reply), 2)}
