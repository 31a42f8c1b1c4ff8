-- floodgate: give back what one admitted request consumed from one limit: the slot of a
-- leaky-bucket request that left before its turn, or, on Redis Cluster, a limit decided in
-- one slot when a limit in another slot refused the request.
-- Mirrors algorithm::refund() in src/limit/algorithm.rs; the state encodings are those of
-- decide.lua (a plain counter, or packed doubles after ':'): any other value has nothing
-- to give back.
-- KEYS[1]: the counter key. ARGV: algorithm (1 fixed, 2 sliding, 3 token, 4 leaky), a, b, c
-- (as in decide.lua), cost.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local algorithm = tonumber(ARGV[1])
local a, b, c = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local key = KEYS[1]
local stored = redis.call('GET', key)
if not stored then return 0 end
local pttl = redis.call('PTTL', key)
if pttl <= 0 then return 0 end

if algorithm ~= 1 and string.byte(stored) ~= 58 then return 0 end

-- The numbers of a sliding window (three) or a bucket (two).
local function state(count)
  return struct.unpack(count == 3 and '<ddd' or '<dd', stored, 2)
end

if algorithm == 1 then
  -- DECRBY keeps the key's expiry: the window does not move.
  redis.call('DECRBY', key, math.min(cost, tonumber(stored)))
elseif algorithm == 2 then
  local i, current, previous = state(3)
  if i == math.floor(now / b) then
    local value = struct.pack('<Bddd', 58, i, math.max(0, current - cost), previous)
    redis.call('SET', key, value, 'PX', pttl)
  end
elseif algorithm == 3 then
  local tokens, updated = state(2)
  redis.call('SET', key, struct.pack('<Bdd', 58, math.min(c, tokens + cost), updated), 'PX', pttl)
else
  local tat, step = state(2)
  local new_tat = math.max(now, tat - cost * b / a)
  local value = struct.pack('<Bdd', 58, math.floor(new_tat + 0.5), step)
  redis.call('SET', key, value, 'PX', math.max(1, math.ceil((new_tat - now) / 1000)))
end
return 1
