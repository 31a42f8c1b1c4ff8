-- floodgate: decide rate limits for a batch of requests, each atomic and all-or-nothing.
-- Mirrors src/limit/algorithm.rs and decide_all() in src/limit/mod.rs; change them together.
-- The encoding is written by src/limit/decide_call.rs.
--
-- KEYS: the batch's distinct counter keys, then its distinct lock keys.
-- ARGV[1]: the number of counter keys C (KEYS[1..C]).
-- ARGV[2]: U: counter keys 1..U are each used by exactly one check of the batch.
-- ARGV[3]: the number of limit specs S, then 7 values per spec:
--   algorithm (1 fixed_window, 2 sliding_window, 3 token_bucket, 4 leaky_bucket),
--   a, b, c (fixed/sliding: limit, window_us, 0; buckets: rate, per_us, burst),
--   cost, lockout_us (0: none), shadow (1: never refuses; consumes only when the request
--   is admitted and it admits too).
-- Then the plan, one binary string: every number in two bytes, big-endian. Per request its
--   number of checks, and per check: spec index, counter key index, and (only when the
--   spec has a lock-out) lock key index. Numbers, not decimal arguments: Redis turns every
--   argument into a string object and a Lua string, which cost more than the decision.
-- Returns, per check in order: remaining, reset_us, and 4 × time + outcome, where outcome
--   is 0 allowed, 1 delayed, 2 rejected, 3 locked, and time is retry_after_us (rejected,
--   locked) or delay_us (delayed), at most 2^50 µs (35 years) so that the sum stays exact
--   in a Lua double. Three reply integers per check instead of four: each costs Redis a
--   reply element and the gateway a parse.
-- Time comes from Redis TIME only, in microseconds (exact in a Lua double).
--
-- Each key is read once per call (one MGET for every counter key; PTTL where a window or
-- a lock needs it), its state is kept here while the requests are decided in order, and
-- each changed key is written once: one MSET for all of them, then PEXPIREAT per key
-- (SET ... PX costs Redis a reply table and a rewrite of the command per key). So a call
-- costs a few commands per distinct key, however many requests it carries, and each
-- request still sees the state the requests before it left: exactly as if they were
-- decided one call each. Expiry instants are the call's TIME plus the state's lifetime,
-- rounded up to the millisecond.
--
-- Stored state: fixed_window is a plain counter (written when its window starts, INCRBY
-- after); the others are one string each: "index:current:previous" (sliding_window),
-- "tokens:updated" (token_bucket; a whole token count as an integer, any other with 17
-- significant digits), "tat:step" (leaky_bucket).

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
local byte, format, match, tonumber, unpack = string.byte, string.format, string.match, tonumber, unpack
local expiry_base = ceil(now / 1000) -- ms; a state lasting d ms expires at expiry_base + d

local function ms(us)
  return max(1, ceil(us / 1000))
end

local function nonneg(x)
  if x < 0 then return 0 end
  return floor(x)
end

-- Counter keys: their stored text, read together; false when absent, and once the live
-- state below has replaced it.
local n_counters, n_single = tonumber(ARGV[1]), tonumber(ARGV[2])
local stored = {}
do
  local chunk = 1000 -- unpack() is bounded by Lua's C stack
  if n_counters > 0 then stored = redis.call('MGET', unpack(KEYS, 1, min(chunk, n_counters))) end
  for first = chunk + 1, n_counters, chunk do
    local last = min(first + chunk - 1, n_counters)
    local values = redis.call('MGET', unpack(KEYS, first, last))
    for i = 1, last - first + 1 do stored[first + i - 1] = values[i] end
  end
end

-- The live state of counters changed in this call: up to three numbers per key index.
local s1, s2, s3 = {}, {}, {}
-- Changed counters: algorithm by key index, with the state's lifetime in ms.
local dirty, ttl = {}, {}
-- Fixed windows: the amount admitted in this call (INCRBY'd when the window existed).
local added = {}

-- Each evaluator takes the key's stored text (false: use the live state) and returns:
-- admitted, delay, remaining_after, remaining_before, reset, retry_after, and the state to
-- keep when the request is admitted (three numbers and its lifetime in ms).
local function fixed_window(k, text, limit, window, _, cost)
  -- count, the window's end, and 1 when the window exists in Redis (nil: no window yet;
  -- it starts with its first admission).
  local count, window_end, exists = s1[k], s2[k], s3[k]
  if text then
    count, window_end, exists = nil, nil, 0
    local pttl = redis.call('PTTL', KEYS[k])
    if pttl > 0 then
      -- The key outlives its window by up to 2 ms (its expiry was rounded up to the
      -- millisecond, and PTTL counts from the current millisecond's start): the window
      -- itself ends no later than `window` from now.
      window_end = now + pttl * 1000
      if window_end > now + window then window_end = now + window end
      count, exists = tonumber(text), 1
    end
  end
  count, window_end = count or 0, window_end or now + window
  local reset = window_end - now
  local admitted = count + cost <= limit
  local after, retry = count, reset
  if admitted then after, retry = count + cost, 0 end
  return admitted, 0, nonneg(limit - after), nonneg(limit - count), reset, retry,
    after, window_end, exists or 0, ms(window)
end

local function sliding_window(k, text, limit, window, _, cost)
  local i, current, previous = s1[k], s2[k], s3[k]
  if text then
    local a, b, c = match(text, '^([^:]+):([^:]+):(.+)$')
    i, current, previous = tonumber(a), tonumber(b), tonumber(c)
  end
  local index = floor(now / window)
  local into = now - index * window
  if i == index then
    -- as stored
  elseif i == index - 1 then
    current, previous = 0, current
  else
    current, previous = 0, 0
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

local function token_bucket(k, text, rate, per, burst, cost)
  local saved, updated = s1[k], s2[k]
  if text then
    local t, u = match(text, '^([^:]+):(.+)$')
    saved, updated = tonumber(t), tonumber(u)
  end
  -- Written without min/max/floor calls: this runs for nearly every decision. The counts
  -- returned are never negative, so the reply's truncation to integers floors them.
  local step = per / rate
  local tokens = burst
  if saved then
    local elapsed = now - updated
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

local function leaky_bucket(k, text, rate, per, burst, cost)
  local saved_tat, saved_step = s1[k], s2[k]
  if text then
    local t, s = match(text, '^([^:]+):(.+)$')
    saved_tat, saved_step = tonumber(t), tonumber(s)
  end
  local step = per / rate
  local depth = burst * step
  local tat = now
  if saved_tat then
    tat = max(saved_tat, now)
    if saved_step ~= step then
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

-- Limit specs.
local n_specs = tonumber(ARGV[3])
local algorithms, pa, pb, pc, costs, lockouts, shadows = {}, {}, {}, {}, {}, {}, {}
local argi = 4
for s = 1, n_specs do
  algorithms[s], pa[s], pb[s], pc[s] = tonumber(ARGV[argi]), tonumber(ARGV[argi + 1]),
    tonumber(ARGV[argi + 2]), tonumber(ARGV[argi + 3])
  costs[s], lockouts[s], shadows[s] = tonumber(ARGV[argi + 4]), tonumber(ARGV[argi + 5]), ARGV[argi + 6] == '1'
  argi = argi + 7
end
local plan = ARGV[argi]

local out = {}
local n_out = 0
local max_time = 1125899906842624 -- 2^50 µs: see the reply above
local function emit(outcome, remaining, reset, retry_or_delay)
  if retry_or_delay > max_time then retry_or_delay = max_time end
  out[n_out + 1], out[n_out + 2], out[n_out + 3] = remaining, reset, retry_or_delay * 4 + outcome
  n_out = n_out + 3
end

-- Whole numbers as text, each formatted once per call: expiry instants and the counts of
-- untouched buckets repeat across keys (number-to-string in Lua goes through "%.14g").
-- From 2^53 on, %d would go through a C long (and overflow at 2^63): 17 digits instead.
local exact = 9007199254740992 -- 2^53
local text_of = setmetatable({}, { __index = function(t, n)
  local v = format(n < exact and '%d' or '%.17g', n)
  t[n] = v
  return v
end })

-- Writes: MSET arguments (key, value) and each key's expiry instant in ms.
local set_args, set_at, n_set = {}, {}, 0

-- Queues the write of counter k's state (a window that exists only gains `added`).
local function write(k, algorithm, v1, v2, v3, lifetime, added_now)
  local value
  if algorithm == 1 then
    if v3 == 1 then
      redis.call('INCRBY', KEYS[k], text_of[added_now])
      return
    end
    value = text_of[v1]
  elseif algorithm == 2 then
    value = format('%d:%d:%d', v1, v2, v3)
  elseif algorithm == 3 then
    if v1 % 1 == 0 then
      value = text_of[v1] .. ':' .. text_of[v2]
    else
      -- Nine decimals, formatted as integers: about 0.6k instructions a write fewer than
      -- "%.17g" (callgrind, bench/script_cost.sh with RATE=1).
      local whole = floor(v1)
      value = format('%d.%09d:%d', whole, floor((v1 - whole) * 1e9), v2)
    end
  else
    value = format('%d:%.17g', v1, v2)
  end
  local i = n_set + 1
  set_args[2 * i - 1], set_args[2 * i], set_at[i], n_set = KEYS[k], value, expiry_base + lifetime, i
end

-- An admitted check's new state, written once at the end of the call.
local function keep(s, k, v1, v2, v3, lifetime)
  local algorithm = algorithms[s]
  if algorithm == 1 then added[k] = (added[k] or 0) + costs[s] end
  stored[k], s1[k], s2[k], s3[k], dirty[k], ttl[k] = false, v1, v2, v3, algorithm, lifetime
end

-- Per check of the current request (reused across requests).
local specs, keys, locks, locked = {}, {}, {}, {}
local admitted, delays, afters, befores, resets, retries = {}, {}, {}, {}, {}, {}
local n1, n2, n3, ttls = {}, {}, {}, {}

-- A request of n checks whose numbers start at plan byte p: every check is evaluated
-- first, and the state is kept only when all of them admit. Returns the next plan byte.
local function decide_staged(n, p)
  local all_admitted = true
  for i = 1, n do
    local s_hi, s_lo, k_hi, k_lo, l_hi, l_lo = byte(plan, p, p + 5)
    local s, k = s_hi * 256 + s_lo, k_hi * 256 + k_lo
    p = p + 4
    specs[i], keys[i], locks[i], locked[i] = s, k, false, false
    if lockouts[s] > 0 then
      locks[i] = l_hi * 256 + l_lo
      p = p + 2
      -- A lock lasts `lockout`; its key may outlive it by a millisecond (see fixed_window).
      local left = lock_of(locks[i])
      if left and left > lockouts[s] then left = lockouts[s] end
      locked[i] = left
    end
    admitted[i], delays[i], afters[i], befores[i], resets[i], retries[i], n1[i], n2[i], n3[i], ttls[i] =
      evaluators[algorithms[s]](k, stored[k], pa[s], pb[s], pc[s], costs[s])
    if not shadows[s] and (locked[i] or not admitted[i]) then all_admitted = false end
  end
  for i = 1, n do
    local s = specs[i]
    if locked[i] then
      emit(3, 0, locked[i], locked[i])
    elseif not admitted[i] then
      local retry, reset = retries[i], resets[i]
      if locks[i] then
        -- The lock now decides when the key is free again.
        local lockout = lockouts[s]
        redis.call('SET', KEYS[locks[i]], '1', 'PX', ms(lockout), 'NX')
        lock_left[locks[i]] = ms(lockout) * 1000
        retry, reset = max(retry, lockout), max(reset, lockout)
      end
      emit(2, befores[i], reset, retry)
    elseif not all_admitted then
      emit(0, befores[i], resets[i], 0)
    else
      keep(s, keys[i], n1[i], n2[i], n3[i], ttls[i])
      emit(delays[i] > 0 and 1 or 0, afters[i], resets[i], delays[i])
    end
  end
  return p
end

local p, plan_end = 1, #plan
while p < plan_end do
  local n_hi, n_lo, s_hi, s_lo, k_hi, k_lo = byte(plan, p, p + 5)
  local n, s = n_hi * 256 + n_lo, s_hi * 256 + s_lo
  if n == 1 and lockouts[s] == 0 then
    -- One check without a lock-out (the common request): nothing to stage, and a key no
    -- other check uses is written at once. keep() and emit() are written out here: in
    -- Redis's Lua each function call costs about 1.4k instructions, on a decision of
    -- about 27k (callgrind, token bucket, distinct keys).
    local k = k_hi * 256 + k_lo
    p = p + 6
    local algorithm = algorithms[s]
    local ok, delay, after, before, reset, retry, v1, v2, v3, lifetime =
      evaluators[algorithm](k, stored[k], pa[s], pb[s], pc[s], costs[s])
    local o = n_out
    n_out = o + 3
    if not ok then
      if retry > max_time then retry = max_time end
      out[o + 1], out[o + 2], out[o + 3] = before, reset, retry * 4 + 2
    else
      if k <= n_single then
        write(k, algorithm, v1, v2, v3, lifetime, costs[s])
      else
        if algorithm == 1 then added[k] = (added[k] or 0) + costs[s] end
        stored[k], s1[k], s2[k], s3[k], dirty[k], ttl[k] = false, v1, v2, v3, algorithm, lifetime
      end
      if delay > 0 then
        if delay > max_time then delay = max_time end
        out[o + 1], out[o + 2], out[o + 3] = after, reset, delay * 4 + 1
      else
        out[o + 1], out[o + 2], out[o + 3] = after, reset, 0
      end
    end
  else
    p = decide_staged(n, p + 2)
  end
end

-- One write per changed counter.
for k = 1, n_counters do
  local algorithm = dirty[k]
  if algorithm then write(k, algorithm, s1[k], s2[k], s3[k], ttl[k], added[k]) end
end
do
  local chunk = 500 -- key-value pairs per MSET (unpack() is bounded by Lua's C stack)
  for first = 1, n_set, chunk do
    local last = min(first + chunk - 1, n_set)
    redis.call('MSET', unpack(set_args, 2 * first - 1, 2 * last))
  end
  for i = 1, n_set do
    redis.call('PEXPIREAT', set_args[2 * i - 1], text_of[set_at[i]])
  end
end
return out
