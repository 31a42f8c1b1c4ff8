-- floodgate: give back what one admitted request consumed from one limit: the slot of a
-- leaky-bucket request that left before its turn, or, on Redis Cluster, a limit decided in
-- one slot when a limit in another slot refused the request.
-- Mirrors algorithm::refund() in src/limit/algorithm.rs.
-- KEYS[1]: the counter key. ARGV: algorithm (1 fixed, 2 sliding, 3 token, 4 leaky), a, b, c
-- (as in decide.lua), cost.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local algorithm = tonumber(ARGV[1])
local a, b, c = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local key = KEYS[1]

if algorithm == 1 then
  local count = tonumber(redis.call('GET', key) or '0')
  if count > 0 then
    -- DECRBY keeps the key's expiry: the window does not move.
    redis.call('DECRBY', key, math.min(cost, count))
  end
elseif algorithm == 2 then
  local index = math.floor(now / b)
  local stored = redis.call('HMGET', key, 'i', 'c')
  if tonumber(stored[1]) == index then
    redis.call('HSET', key, 'c', math.max(0, tonumber(stored[2]) - cost))
  end
elseif algorithm == 3 then
  local tokens = tonumber(redis.call('HGET', key, 't'))
  if tokens then
    redis.call('HSET', key, 't', string.format('%.17g', math.min(c, tokens + cost)))
  end
else
  local tat = tonumber(redis.call('HGET', key, 'tat'))
  if tat then
    local new_tat = math.max(now, tat - cost * b / a)
    redis.call('HSET', key, 'tat', string.format('%.17g', math.floor(new_tat + 0.5)))
    redis.call('PEXPIRE', key, math.max(1, math.ceil((new_tat - now) / 1000)))
  end
end
return 1
