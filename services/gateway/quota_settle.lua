-- Replace a reservation by actual usage, exactly once. KEYS[1] reservation hash.
-- ARGV[1] actual tokens. Token counters get back (reserved - actual); request counters keep
-- their 1; concurrency releases the slot. Returns 1 if settled now, 0 if already settled/expired.
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
