-- floodgate: take one of a concurrency limit's slots for a request, as a lease.
-- KEYS[1]: the key's sorted set of leases (member: the holder's id, score: expiry in ms).
-- ARGV[1]: this lease's id; ARGV[2]: the limit; ARGV[3]: the lease's length in ms.
-- Leases whose holder stopped renewing them (a crashed instance) are dropped first.
-- Returns 1 when the slot is taken, 0 when every slot is.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
local lease = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[1], lease)
return 1
