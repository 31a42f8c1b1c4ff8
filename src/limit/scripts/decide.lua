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
--
-- State: fixed_window is a plain counter (INCRBY, PEXPIRE only when created); the others
-- are one string each, written with SET PX: "index:current:previous" (sliding_window),
-- "tokens:updated" (token_bucket, tokens with 17 significant digits), "tat:step"
-- (leaky_bucket). Two commands per limit and decision.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
local format, match = string.format, string.match

local function ms(us)
  return max(1, ceil(us / 1000))
end

local function nonneg(x)
  if x < 0 then return 0 end
  return floor(x)
end

-- Each evaluator returns: admitted, delay, remaining_after, remaining_before, reset,
-- retry_after, and the write: kind (1: INCRBY cost and PEXPIRE if new, 2: SET PX), value,
-- ttl in ms.
local function fixed_window(key, limit, window, cost)
  local stored = redis.call('GET', key)
  local count, window_end, new = 0, now + window, 1
  if stored then
    local pttl = redis.call('PTTL', key)
    if pttl > 0 then
      count, window_end, new = tonumber(stored), now + pttl * 1000, 0
    end
  end
  local reset = window_end - now
  local admitted = count + cost <= limit
  local after = count
  local retry = reset
  if admitted then
    after = count + cost
    retry = 0
  end
  -- new = 1: the window starts now, so the counter gets its expiry (and only then).
  return admitted, 0, nonneg(limit - after), nonneg(limit - count), reset, retry, 1, new, ms(window)
end

local function sliding_window(key, limit, window, cost)
  local index = floor(now / window)
  local into = now - index * window
  local current, previous = 0, 0
  local stored = redis.call('GET', key)
  if stored then
    local i, c, p = match(stored, '^([^:]+):([^:]+):(.+)$')
    i = tonumber(i)
    if i == index then
      current, previous = tonumber(c), tonumber(p)
    elseif i == index - 1 then
      previous = tonumber(c)
    end
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
        retry = until_next + ceil(window * (1 - (limit - cost) / current))
      end
    else
      local needed = window - window * (limit - current - cost) / previous
      retry = max(1, ceil(needed) - into)
    end
  end
  local after = current
  if admitted then after = current + cost end
  return admitted, 0, nonneg(limit - (previous * weight + after)), nonneg(limit - estimate), window - into, retry,
    2, format('%d:%d:%d', index, after, previous), ms(2 * window - into)
end

local function token_bucket(key, rate, per, burst, cost)
  local step = per / rate
  local tokens = burst
  local stored = redis.call('GET', key)
  if stored then
    local t, u = match(stored, '^([^:]+):(.+)$')
    tokens = min(burst, tonumber(t) + max(0, now - tonumber(u)) / step)
  end
  local admitted = tokens >= cost
  local left = tokens
  local retry = 0
  if admitted then
    left = tokens - cost
  else
    retry = max(1, ceil((cost - tokens) * step))
  end
  local until_full = ceil((burst - left) * step)
  return admitted, 0, floor(left), floor(tokens), until_full, retry,
    2, format('%.17g:%d', left, now), ms(max(1, until_full))
end

local function leaky_bucket(key, rate, per, burst, cost)
  local step = per / rate
  local depth = burst * step
  local tat = now
  local stored = redis.call('GET', key)
  if stored then
    local t, s = match(stored, '^([^:]+):(.+)$')
    tat = max(tonumber(t), now)
    if tonumber(s) ~= step then
      -- The rate or depth was edited: no longer a queue than the new depth allows.
      tat = min(tat, now + depth)
    end
  end
  local delay = tat - now
  local wait_for_last = delay + (cost - 1) * step
  local admitted = wait_for_last <= depth
  local new_tat = tat
  local retry, held = 0, 0
  if admitted then
    new_tat = tat + cost * step
    held = floor(delay + 0.5)
  else
    retry = max(1, ceil(wait_for_last - depth))
  end
  local after = max(0, floor((depth - (new_tat - now)) / step) + 1)
  local before = max(0, floor((depth - delay) / step) + 1)
  return admitted, held, after, before, ceil(new_tat - now), retry,
    2, format('%d:%.17g', floor(new_tat + 0.5), step), ms(max(1, ceil(new_tat - now)))
end

local evaluators = { fixed_window, sliding_window, token_bucket, leaky_bucket }

local out = {}
local n_out = 0
local function emit(outcome, remaining, reset, retry, delay)
  out[n_out + 1], out[n_out + 2], out[n_out + 3], out[n_out + 4], out[n_out + 5] =
    outcome, remaining, reset, retry, delay
  n_out = n_out + 5
end

local argi = 2
local keyi = 1
-- Per check of the current request (reused across requests).
local keys, locks, lockouts, locked, shadows = {}, {}, {}, {}, {}
local admitted, delays, afters, befores, resets, retries = {}, {}, {}, {}, {}, {}
local kinds, values, ttls, costs = {}, {}, {}, {}
for _ = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[argi])
  argi = argi + 1
  local all_admitted = true
  for i = 1, n do
    local algorithm = tonumber(ARGV[argi])
    local a, b, c = tonumber(ARGV[argi + 1]), tonumber(ARGV[argi + 2]), tonumber(ARGV[argi + 3])
    local cost, lockout = tonumber(ARGV[argi + 4]), tonumber(ARGV[argi + 5])
    local shadow = ARGV[argi + 6] == '1'
    argi = argi + 7
    local key = KEYS[keyi]
    keyi = keyi + 1
    keys[i], lockouts[i], shadows[i], costs[i], locks[i], locked[i] = key, lockout, shadow, cost, false, false
    if lockout > 0 then
      locks[i] = KEYS[keyi]
      keyi = keyi + 1
      local left = redis.call('PTTL', locks[i])
      if left > 0 then locked[i] = left * 1000 end
    end
    if algorithm <= 2 then
      admitted[i], delays[i], afters[i], befores[i], resets[i], retries[i], kinds[i], values[i], ttls[i] =
        evaluators[algorithm](key, a, b, cost)
    else
      admitted[i], delays[i], afters[i], befores[i], resets[i], retries[i], kinds[i], values[i], ttls[i] =
        evaluators[algorithm](key, a, b, c, cost)
    end
    if not shadow and (locked[i] or not admitted[i]) then all_admitted = false end
  end
  for i = 1, n do
    if locked[i] then
      emit(3, 0, locked[i], locked[i], 0)
    elseif not admitted[i] then
      local retry, reset = retries[i], resets[i]
      if locks[i] then
        -- The lock now decides when the key is free again.
        redis.call('SET', locks[i], '1', 'PX', ms(lockouts[i]), 'NX')
        retry, reset = max(retry, lockouts[i]), max(reset, lockouts[i])
      end
      emit(2, befores[i], reset, retry, 0)
    elseif not all_admitted then
      emit(0, befores[i], resets[i], 0, 0)
    else
      if kinds[i] == 1 then
        redis.call('INCRBY', keys[i], costs[i])
        if values[i] == 1 then redis.call('PEXPIRE', keys[i], ttls[i]) end
      else
        redis.call('SET', keys[i], values[i], 'PX', ttls[i])
      end
      local outcome = 0
      if delays[i] > 0 then outcome = 1 end
      emit(outcome, afters[i], resets[i], 0, delays[i])
    end
  end
end
return out
