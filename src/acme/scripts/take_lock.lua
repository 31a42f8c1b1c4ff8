-- The ACME ordering lock (src/acme/storage.rs): takes KEYS[1] for holder ARGV[1] for
-- ARGV[2] milliseconds when it is free, or extends it when ARGV[1] already holds it.
-- Returns 1 when ARGV[1] holds it now, 0 when another holder does.
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
