-- The ACME ordering lock (src/acme/storage.rs): deletes KEYS[1] when holder ARGV[1] still
-- holds it (never another holder's lock, taken over after ARGV[1]'s lease ran out).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
