-- floodgate: decide rate limits for a batch of requests, each atomic and all-or-nothing.
-- Mirrors src/limit/algorithm.rs and decide_all() in src/limit/mod.rs; change them together.
-- The encoding is written by src/limit/decide_call.rs.
--
-- KEYS: the batch's distinct counter keys, then its distinct lock keys.
-- ARGV[1]: the number of counter keys C (KEYS[1..C]).
-- ARGV[2]: the number of limit specs S, then 7 values per spec:
--   algorithm (1 fixed_window, 2 sliding_window, 3 token_bucket, 4 leaky_bucket),
--   a, b, c (fixed/sliding: limit, window_us, 0; buckets: rate, per_us, burst),
--   cost, lockout_us (0: none), shadow (1: never refuses; consumes only when the request
--   is admitted and it admits too).
-- Then the number of requests, and per request its number of checks and per check: spec
--   index, counter key index, and (only when the spec has a lock-out) lock key index.
-- Returns, per check in order: outcome (0 allowed, 1 delayed, 2 rejected, 3 locked),
--   remaining, reset_us, retry_after_us, delay_us.
-- Time comes from Redis TIME only, in microseconds (exact in a Lua double).
--
-- Each key is read once per call (one MGET for every counter key; PTTL where a window or
-- a lock needs it), its state is kept here while the requests are decided in order, and
-- each changed key is written once at the end. So a call costs a few commands per distinct
-- key, however many requests it carries, and each request still sees the state the
-- requests before it left: exactly as if they were decided one call each.
--
-- Stored state: fixed_window is a plain counter (SET PX when its window starts, INCRBY
-- after); the others are one string each, written with SET PX: "index:current:previous"
-- (sliding_window), "tokens:updated" (token_bucket; a whole token count as an integer,
-- any other with 17 significant digits), "tat:step" (leaky_bucket).

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
local format, match, tonumber, unpack = string.format, string.match, tonumber, unpack

local function ms(us)
  return max(1, ceil(us / 1000))
end

local function nonneg(x)
  if x < 0 then return 0 end
  return floor(x)
end

-- Counter keys: their stored text (false when absent), read together.
local n_counters = tonumber(ARGV[1])
local stored = {}
do
  local chunk = 1000 -- unpack() is bounded by Lua's C stack
  for first = 1, n_counters, chunk do
    local last = min(first + chunk - 1, n_counters)
    local values = redis.call('MGET', unpack(KEYS, first, last))
    for i = 1, last - first + 1 do stored[first + i - 1] = values[i] end
  end
end

-- Each counter's live state, parsed on first use: up to three numbers per key index.
local parsed, s1, s2, s3 = {}, {}, {}, {}
-- Changed counters: algorithm by key index, with the write's expiry in ms.
local dirty, ttl = {}, {}
-- Fixed windows: created in this call (written with SET PX), or the amount to INCRBY.
local created, added = {}, {}

-- Each evaluator returns: admitted, delay, remaining_after, remaining_before, reset,
-- retry_after, and the state to keep when the request is admitted (three numbers and the
-- expiry in ms).
local function fixed_window(k, limit, window, _, cost)
  if not parsed[k] then
    parsed[k] = true
    if stored[k] then
      local pttl = redis.call('PTTL', KEYS[k])
      if pttl > 0 then s1[k], s2[k] = tonumber(stored[k]), now + pttl * 1000 end
    end
  end
  -- s2 (the window's end) is nil until the window exists: it starts with its first admission.
  local count, window_end = s1[k] or 0, s2[k] or now + window
  local reset = window_end - now
  local admitted = count + cost <= limit
  local after, retry = count, reset
  if admitted then after, retry = count + cost, 0 end
  return admitted, 0, nonneg(limit - after), nonneg(limit - count), reset, retry,
    after, window_end, 0, ms(window)
end

local function sliding_window(k, limit, window, _, cost)
  if not parsed[k] then
    parsed[k] = true
    if stored[k] then
      local i, c, p = match(stored[k], '^([^:]+):([^:]+):(.+)$')
      s1[k], s2[k], s3[k] = tonumber(i), tonumber(c), tonumber(p)
    end
  end
  local index = floor(now / window)
  local into = now - index * window
  local current, previous = 0, 0
  local i = s1[k]
  if i == index then
    current, previous = s2[k], s3[k]
  elseif i == index - 1 then
    previous = s2[k]
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
    index, after, previous, ms(2 * window - into)
end

local function token_bucket(k, rate, per, burst, cost)
  if not parsed[k] then
    parsed[k] = true
    if stored[k] then
      local t, u = match(stored[k], '^([^:]+):(.+)$')
      s1[k], s2[k] = tonumber(t), tonumber(u)
    end
  end
  -- Written without min/max/floor calls: this runs for nearly every decision. The counts
  -- returned are never negative, so the reply's truncation to integers floors them.
  local step = per / rate
  local tokens = burst
  local saved = s1[k]
  if saved then
    local elapsed = now - s2[k]
    if elapsed > 0 then saved = saved + elapsed / step end
    if saved < burst then tokens = saved end
  end
  local left, retry = tokens, 0
  local admitted = tokens >= cost
  if admitted then
    left = tokens - cost
  else
    retry = ceil((cost - tokens) * step)
    if retry < 1 then retry = 1 end
  end
  local until_full = ceil((burst - left) * step)
  local expiry = 1
  if until_full > 1000 then expiry = ceil(until_full / 1000) end
  return admitted, 0, left, tokens, until_full, retry, left, now, 0, expiry
end

local function leaky_bucket(k, rate, per, burst, cost)
  if not parsed[k] then
    parsed[k] = true
    if stored[k] then
      local t, s = match(stored[k], '^([^:]+):(.+)$')
      s1[k], s2[k] = tonumber(t), tonumber(s)
    end
  end
  local step = per / rate
  local depth = burst * step
  local tat = now
  if s1[k] then
    tat = max(s1[k], now)
    if s2[k] ~= step then
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
    floor(new_tat + 0.5), step, 0, ms(max(1, ceil(new_tat - now)))
end

local evaluators = { fixed_window, sliding_window, token_bucket, leaky_bucket }

-- Lock keys: microseconds left in a live lock (false: none), read on first use.
local lock_left = {}
local function lock_of(l)
  local left = lock_left[l]
  if left == nil then
    local pttl = redis.call('PTTL', KEYS[l])
    left = pttl > 0 and pttl * 1000
    lock_left[l] = left
  end
  return left
end

-- ARGV numbers repeat (counts, spec and key indexes): convert each distinct string once.
local num = setmetatable({}, { __index = function(t, s)
  local v = tonumber(s)
  t[s] = v
  return v
end })

-- Limit specs.
local n_specs = tonumber(ARGV[2])
local algorithms, pa, pb, pc, costs, lockouts, shadows = {}, {}, {}, {}, {}, {}, {}
local argi = 3
for s = 1, n_specs do
  algorithms[s], pa[s], pb[s], pc[s] = tonumber(ARGV[argi]), tonumber(ARGV[argi + 1]),
    tonumber(ARGV[argi + 2]), tonumber(ARGV[argi + 3])
  costs[s], lockouts[s], shadows[s] = tonumber(ARGV[argi + 4]), tonumber(ARGV[argi + 5]), ARGV[argi + 6] == '1'
  argi = argi + 7
end

local out = {}
local n_out = 0
local function emit(outcome, remaining, reset, retry, delay)
  out[n_out + 1], out[n_out + 2], out[n_out + 3], out[n_out + 4], out[n_out + 5] =
    outcome, remaining, reset, retry, delay
  n_out = n_out + 5
end

-- An admitted check's new state, written once at the end of the call.
local function keep(s, k, v1, v2, v3, expiry)
  local algorithm = algorithms[s]
  if algorithm == 1 then
    if s2[k] == nil then created[k] = true end
    added[k] = (added[k] or 0) + costs[s]
  end
  s1[k], s2[k], s3[k], dirty[k], ttl[k] = v1, v2, v3, algorithm, expiry
end

-- Per check of the current request (reused across requests).
local specs, keys, locks, locked = {}, {}, {}, {}
local admitted, delays, afters, befores, resets, retries = {}, {}, {}, {}, {}, {}
local n1, n2, n3, ttls = {}, {}, {}, {}

-- A request of n checks whose arguments start at ARGV[first]: every check is evaluated
-- first, and the state is kept only when all of them admit. Returns the next argument.
local function decide_staged(n, first)
  local argi = first
  local all_admitted = true
  for i = 1, n do
    local s, k = num[ARGV[argi]], num[ARGV[argi + 1]]
    argi = argi + 2
    specs[i], keys[i], locks[i], locked[i] = s, k, false, false
    if lockouts[s] > 0 then
      locks[i] = num[ARGV[argi]]
      argi = argi + 1
      locked[i] = lock_of(locks[i])
    end
    admitted[i], delays[i], afters[i], befores[i], resets[i], retries[i], n1[i], n2[i], n3[i], ttls[i] =
      evaluators[algorithms[s]](k, pa[s], pb[s], pc[s], costs[s])
    if not shadows[s] and (locked[i] or not admitted[i]) then all_admitted = false end
  end
  for i = 1, n do
    local s = specs[i]
    if locked[i] then
      emit(3, 0, locked[i], locked[i], 0)
    elseif not admitted[i] then
      local retry, reset = retries[i], resets[i]
      if locks[i] then
        -- The lock now decides when the key is free again.
        local lockout = lockouts[s]
        redis.call('SET', KEYS[locks[i]], '1', 'PX', ms(lockout), 'NX')
        lock_left[locks[i]] = ms(lockout) * 1000
        retry, reset = max(retry, lockout), max(reset, lockout)
      end
      emit(2, befores[i], reset, retry, 0)
    elseif not all_admitted then
      emit(0, befores[i], resets[i], 0, 0)
    else
      keep(s, keys[i], n1[i], n2[i], n3[i], ttls[i])
      emit(delays[i] > 0 and 1 or 0, afters[i], resets[i], 0, delays[i])
    end
  end
  return argi
end

local n_requests = tonumber(ARGV[argi])
argi = argi + 1
for _ = 1, n_requests do
  local n, s = num[ARGV[argi]], num[ARGV[argi + 1]]
  if n == 1 and lockouts[s] == 0 then
    -- One check without a lock-out (the common request): nothing to stage. keep() and
    -- emit() are written out here: in Redis's Lua each call cost about 1.4k of the 38k
    -- instructions a decision takes (callgrind, token bucket, distinct keys).
    local k = num[ARGV[argi + 2]]
    argi = argi + 3
    local algorithm = algorithms[s]
    local ok, delay, after, before, reset, retry, v1, v2, v3, expiry =
      evaluators[algorithm](k, pa[s], pb[s], pc[s], costs[s])
    local o = n_out
    n_out = o + 5
    if ok then
      if algorithm == 1 then
        if s2[k] == nil then created[k] = true end
        added[k] = (added[k] or 0) + costs[s]
      end
      s1[k], s2[k], s3[k], dirty[k], ttl[k] = v1, v2, v3, algorithm, expiry
      out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = delay > 0 and 1 or 0, after, reset, 0, delay
    else
      out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = 2, before, reset, retry, 0
    end
  else
    argi = decide_staged(n, argi + 1)
  end
end

-- Whole numbers as text, each formatted once per call: expiries and the counts of
-- untouched buckets repeat across keys (number-to-string in Lua goes through "%.14g").
local text = setmetatable({}, { __index = function(t, n)
  local v = format('%d', n)
  t[n] = v
  return v
end })
local exact = 9007199254740992 -- 2^53: whole numbers below it print exactly with %d

-- One write per changed counter.
for k = 1, n_counters do
  local algorithm = dirty[k]
  if algorithm == 1 then
    if created[k] then
      redis.call('SET', KEYS[k], text[s1[k]], 'PX', text[ttl[k]])
    else
      redis.call('INCRBY', KEYS[k], text[added[k]])
    end
  elseif algorithm == 2 then
    redis.call('SET', KEYS[k], format('%d:%d:%d', s1[k], s2[k], s3[k]), 'PX', text[ttl[k]])
  elseif algorithm == 3 then
    local tokens, value = s1[k], nil
    if tokens % 1 == 0 and tokens < exact then
      value = text[tokens] .. ':' .. text[s2[k]]
    else
      value = format('%.17g:%d', tokens, s2[k])
    end
    redis.call('SET', KEYS[k], value, 'PX', text[ttl[k]])
  elseif algorithm == 4 then
    redis.call('SET', KEYS[k], format('%d:%.17g', s1[k], s2[k]), 'PX', text[ttl[k]])
  end
end
return out
