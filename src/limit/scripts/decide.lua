-- floodgate: decide rate limits for a batch of requests, each atomic and all-or-nothing.
-- Mirrors src/limit/algorithm.rs and decide_all() in src/limit/mod.rs; change them together.
--
-- ARGV[1]: number of requests. Then per request: its number of checks, and per check:
--   algorithm (1 fixed_window, 2 sliding_window, 3 token_bucket, 4 leaky_bucket),
--   a, b, c (fixed/sliding: limit, window_us, 0; buckets: rate, per_us, burst),
--   cost, lockout_us (0: none), shadow (1: never refuses; consumes only when the request
--   is admitted and it admits too).
-- KEYS: per check, its counter key, then its lock key when lockout_us > 0.
-- Returns, per check in order: outcome (0 allowed, 1 delayed, 2 rejected, 3 locked),
--   remaining, reset_us, retry_after_us, delay_us.
-- Time comes from Redis TIME only, in microseconds (exact in a Lua double).

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

local function ms(us)
  return math.max(1, math.ceil(us / 1000))
end

local function floor_nonneg(x)
  if x < 0 then return 0 end
  return math.floor(x)
end

-- Each evaluator returns: admitted, delay, remaining_after, remaining_before, reset,
-- retry_after, and a function that writes the new state.
local function fixed_window(key, limit, window, cost)
  local count = tonumber(redis.call('GET', key) or '0')
  local pttl = redis.call('PTTL', key)
  local window_end
  if count > 0 and pttl > 0 then
    window_end = now + pttl * 1000
  else
    count = 0
    window_end = now + window
  end
  local reset = window_end - now
  local admitted = count + cost <= limit
  local after = count
  if admitted then after = count + cost end
  local retry = 0
  if not admitted then retry = reset end
  local write = function()
    redis.call('INCRBY', key, cost)
    if count == 0 then redis.call('PEXPIRE', key, ms(window)) end
  end
  return admitted, 0, floor_nonneg(limit - after), floor_nonneg(limit - count), reset, retry, write
end

local function sliding_window(key, limit, window, cost)
  local index = math.floor(now / window)
  local into = now - index * window
  local stored = redis.call('HMGET', key, 'i', 'c', 'p')
  local current, previous = 0, 0
  local stored_index = tonumber(stored[1])
  if stored_index == index then
    current, previous = tonumber(stored[2]), tonumber(stored[3])
  elseif stored_index ~= nil and stored_index + 1 == index then
    previous = tonumber(stored[2])
  end
  local weight = (window - into) / window
  local estimate = previous * weight + current
  local admitted = estimate + cost <= limit
  local retry = 0
  if not admitted then
    if current + cost > limit or previous == 0 then
      local until_next = window - into
      if current == 0 or cost > limit then
        retry = until_next
      else
        retry = until_next + math.ceil(window * (1 - (limit - cost) / current))
      end
    else
      local needed = window - window * (limit - current - cost) / previous
      retry = math.max(1, math.ceil(needed) - into)
    end
  end
  local after = current
  if admitted then after = current + cost end
  local ttl = 2 * window - into
  local write = function()
    redis.call('HSET', key, 'i', index, 'c', after, 'p', previous)
    redis.call('PEXPIRE', key, ms(ttl))
  end
  return admitted, 0, floor_nonneg(limit - (previous * weight + after)), floor_nonneg(limit - estimate),
    window - into, retry, write
end

local function token_bucket(key, rate, per, burst, cost)
  local step = per / rate
  local stored = redis.call('HMGET', key, 't', 'u')
  local tokens = burst
  if stored[1] then
    tokens = math.min(burst, tonumber(stored[1]) + math.max(0, now - tonumber(stored[2])) / step)
  end
  local admitted = tokens >= cost
  local left = tokens
  if admitted then left = tokens - cost end
  local until_full = math.ceil((burst - left) * step)
  local retry = 0
  if not admitted then retry = math.max(1, math.ceil((cost - tokens) * step)) end
  local write = function()
    -- Fractional tokens are kept: stored as a string with 17 significant digits.
    redis.call('HSET', key, 't', string.format('%.17g', left), 'u', now)
    redis.call('PEXPIRE', key, ms(math.max(1, until_full)))
  end
  return admitted, 0, math.floor(left), math.floor(tokens), until_full, retry, write
end

local function leaky_bucket(key, rate, per, burst, cost)
  local step = per / rate
  local depth = burst * step
  local stored = redis.call('HMGET', key, 'tat', 's')
  local tat = now
  if stored[1] then
    tat = math.max(tonumber(stored[1]), now)
    if tonumber(stored[2]) ~= step then
      -- The rate or depth was edited: no longer a queue than the new depth allows.
      tat = math.min(tat, now + depth)
    end
  end
  local delay = tat - now
  local wait_for_last = delay + (cost - 1) * step
  local admitted = wait_for_last <= depth
  local new_tat = tat
  if admitted then new_tat = tat + cost * step end
  local function room(queued)
    return math.max(0, math.floor((depth - queued) / step) + 1)
  end
  local retry = 0
  local admitted_delay = 0
  if admitted then
    admitted_delay = math.floor(delay + 0.5)
  else
    retry = math.max(1, math.ceil(wait_for_last - depth))
  end
  local write = function()
    redis.call('HSET', key, 'tat', string.format('%.17g', math.floor(new_tat + 0.5)), 's', string.format('%.17g', step))
    redis.call('PEXPIRE', key, ms(math.max(1, math.ceil(new_tat - now))))
  end
  return admitted, admitted_delay, room(new_tat - now), room(delay), math.ceil(new_tat - now), retry, write
end

local evaluators = { fixed_window, sliding_window, token_bucket, leaky_bucket }

local out = {}
local argi = 2
local keyi = 1
for _ = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[argi])
  argi = argi + 1
  local checks = {}
  local all_admitted = true
  for i = 1, n do
    local algorithm = tonumber(ARGV[argi])
    local a, b, c = tonumber(ARGV[argi + 1]), tonumber(ARGV[argi + 2]), tonumber(ARGV[argi + 3])
    local cost, lockout = tonumber(ARGV[argi + 4]), tonumber(ARGV[argi + 5])
    local shadow = ARGV[argi + 6] == '1'
    argi = argi + 7
    local check = { key = KEYS[keyi], lockout = lockout }
    keyi = keyi + 1
    if lockout > 0 then
      check.lock = KEYS[keyi]
      keyi = keyi + 1
      local left = redis.call('PTTL', check.lock)
      if left > 0 then check.locked = left * 1000 end
    end
    if algorithm <= 2 then
      check.admitted, check.delay, check.after, check.before, check.reset, check.retry, check.write =
        evaluators[algorithm](check.key, a, b, cost)
    else
      check.admitted, check.delay, check.after, check.before, check.reset, check.retry, check.write =
        evaluators[algorithm](check.key, a, b, c, cost)
    end
    if not shadow and (check.locked or not check.admitted) then all_admitted = false end
    checks[i] = check
  end
  for _, check in ipairs(checks) do
    if check.locked then
      out[#out + 1] = 3; out[#out + 1] = 0; out[#out + 1] = check.locked
      out[#out + 1] = check.locked; out[#out + 1] = 0
    elseif not check.admitted then
      local retry = check.retry
      if check.lock then
        redis.call('SET', check.lock, '1', 'PX', ms(check.lockout), 'NX')
        retry = math.max(retry, check.lockout)
      end
      out[#out + 1] = 2; out[#out + 1] = check.before; out[#out + 1] = check.reset
      out[#out + 1] = retry; out[#out + 1] = 0
    elseif not all_admitted then
      out[#out + 1] = 0; out[#out + 1] = check.before; out[#out + 1] = check.reset
      out[#out + 1] = 0; out[#out + 1] = 0
    else
      check.write()
      local outcome = 0
      if check.delay > 0 then outcome = 1 end
      out[#out + 1] = outcome; out[#out + 1] = check.after; out[#out + 1] = check.reset
      out[#out + 1] = 0; out[#out + 1] = check.delay
    end
  end
end
return out
