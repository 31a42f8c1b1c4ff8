-- floodgate: one key's stored state and its lock's time left, changing nothing (the admin
-- API's read). KEYS[1]: the counter; KEYS[2], when given: its lock.
-- Returns: Redis TIME (seconds, microseconds), the counter's stored value (false when
-- absent), its PTTL, and the lock's PTTL (-2 when absent or not asked for).
local time = redis.call('TIME')
local lock = -2
if KEYS[2] then lock = redis.call('PTTL', KEYS[2]) end
return { time[1], time[2], redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1]), lock }
