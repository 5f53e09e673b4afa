-- Atomically check every quota window of a request, then reserve its worst case in all of them.
-- KEYS[1]        reservation hash for this request (holds what settle must refund)
-- KEYS[2..n+1]   one counter per check (string counters or, for "concurrent", a sorted set)
-- ARGV[1] now (ms)   ARGV[2] request id   ARGV[3] reservation ttl (s)   ARGV[4] n checks
-- then per check, 5 args: kind ("add"|"concurrent"), limit (-1 = none), amount, ttl (s), name
-- A "concurrent" amount is a number of units (engine sequences): members rid, rid#1 .. rid#(amount-1),
-- all scored with the reservation's expiry so a dead holder's units leave together.
-- Returns {1, remaining...} on success or {0, failed check name, limit, current}; the caller knows
-- when the refusing window ends (Retry-After), so the script does not guess it from a key's TTL.
local now = tonumber(ARGV[1])
local rid = ARGV[2]
local res_ttl = tonumber(ARGV[3])
local n = tonumber(ARGV[4])

if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, 'duplicate_request', 0, 0}
end

local current = {}
for i = 1, n do
  local base = 4 + (i - 1) * 5
  local kind, limit, amount = ARGV[base + 1], tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local name = ARGV[base + 5]
  local key = KEYS[i + 1]
  local cur
  if kind == 'concurrent' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)  -- reservations whose holder vanished
    cur = redis.call('ZCARD', key)
  else
    cur = tonumber(redis.call('GET', key) or '0')
  end
  current[i] = cur
  if limit >= 0 and cur + amount > limit then
    return {0, name, limit, cur}
  end
end

local remaining = {}
for i = 1, n do
  local base = 4 + (i - 1) * 5
  local kind, limit, amount = ARGV[base + 1], tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local ttl, name = tonumber(ARGV[base + 4]), ARGV[base + 5]
  local key = KEYS[i + 1]
  if kind == 'concurrent' then
    local expires = now + res_ttl * 1000
    redis.call('ZADD', key, expires, rid)
    local j = 1
    while j < amount do  -- in chunks: unpack() is bounded by Lua's stack
      local args = {}
      for u = j, math.min(j + 499, amount - 1) do
        args[#args + 1] = expires
        args[#args + 1] = rid .. '#' .. u
      end
      redis.call('ZADD', key, unpack(args))
      j = j + 500
    end
    redis.call('EXPIRE', key, res_ttl)
  else
    redis.call('INCRBY', key, amount)
    if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ttl) end
  end
  redis.call('HSET', KEYS[1], 'k' .. i, key, 'kind' .. i, kind, 'amt' .. i, amount, 'name' .. i, name)
  local left = -1
  if limit >= 0 then left = limit - current[i] - amount end
  remaining[i] = left
end
redis.call('HSET', KEYS[1], 'n', n, 'at', now)
redis.call('EXPIRE', KEYS[1], res_ttl)
local out = {1}
for i = 1, n do out[i + 1] = remaining[i] end
return out
