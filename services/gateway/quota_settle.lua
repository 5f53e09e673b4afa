-- Replace a reservation by actual usage, exactly once. KEYS[1] reservation hash.
-- ARGV[1] actual tokens. Token counters get back (reserved - actual); request counters keep
-- their 1; concurrency releases every unit the reservation holds (rid, rid#1 .. rid#(amt-1)).
-- Returns 1 if settled now, 0 if already settled/expired.
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
if n == 0 then return 0 end
local actual = tonumber(ARGV[1])
local rid = ARGV[2]
for i = 1, n do
  local key = redis.call('HGET', KEYS[1], 'k' .. i)
  local kind = redis.call('HGET', KEYS[1], 'kind' .. i)
  local amt = tonumber(redis.call('HGET', KEYS[1], 'amt' .. i))
  local name = redis.call('HGET', KEYS[1], 'name' .. i)
  if kind == 'concurrent' then
    redis.call('ZREM', key, rid)
    local j = 1
    while j < amt do  -- in chunks: unpack() is bounded by Lua's stack
      local members = {}
      for u = j, math.min(j + 499, amt - 1) do members[#members + 1] = rid .. '#' .. u end
      redis.call('ZREM', key, unpack(members))
      j = j + 500
    end
  elseif string.find(name, 'tokens') then
    local refund = amt - actual
    if refund > 0 and redis.call('EXISTS', key) == 1 then
      redis.call('DECRBY', key, refund)
    elseif refund < 0 and redis.call('EXISTS', key) == 1 then
      redis.call('INCRBY', key, -refund)
    end
  end
end
redis.call('DEL', KEYS[1])
return 1
