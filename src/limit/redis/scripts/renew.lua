-- floodgate: renew the leases an instance still holds on one key.
-- KEYS[1]: the key's sorted set of leases; ARGV[1]: the lease length in ms; ARGV[2..]:
-- the ids of the leases held (a lease dropped meanwhile is not brought back).
local time = redis.call('TIME')
local until_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i])
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1
