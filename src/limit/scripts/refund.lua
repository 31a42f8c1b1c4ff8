-- floodgate: give back the leaky-bucket slot of a request that left before its turn.
-- Mirrors algorithm::refund() in src/limit/algorithm.rs.
-- KEYS[1]: the leaky bucket's key. ARGV[1]: the slot length in microseconds.
local tat = tonumber(redis.call('HGET', KEYS[1], 'tat'))
if not tat then return 0 end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local new_tat = math.max(now, tat - tonumber(ARGV[1]))
redis.call('HSET', KEYS[1], 'tat', string.format('%.17g', math.floor(new_tat + 0.5)))
redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil((new_tat - now) / 1000)))
return 1
