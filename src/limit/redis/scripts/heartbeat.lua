-- floodgate: announce this instance and count the live ones.
-- KEYS[1]: the instances sorted set. ARGV[1]: this instance's id. ARGV[2]: liveness in ms.
-- Members are scored by their last heartbeat (Redis TIME, ms); stale ones are removed and
-- the set expires with the last instance, so nothing grows without bound.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], ttl)
return redis.call('ZCARD', KEYS[1])
