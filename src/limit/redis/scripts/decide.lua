-- floodgate: decide rate limits for a batch of requests, each atomic and all-or-nothing.
-- Mirrors src/limit/algorithm.rs and decide_all() in src/limit/mod.rs; change them together.
-- The encoding is written, and the reply read, by src/limit/redis/wire.rs.
--
-- KEYS: the batch's distinct counter keys, then its distinct lock keys.
-- ARGV[1]: the call, one binary string, big-endian:
--   C, U and S, two bytes each: C counter keys (KEYS[1..C]), of which keys 1..U are each
--     used by exactly one check of the batch; S limit specs.
--   S specs: the algorithm in one byte (1 fixed_window, 2 sliding_window, 3 token_bucket,
--     4 leaky_bucket); a, b, c (fixed/sliding: limit, window_us, 0; buckets: rate, per_us,
--     burst), cost and lockout_us (0: none; negative: read, but a refusal does not start
--     it), each an eight-byte double; shadow in one byte
--     (1: never refuses; consumes only when the request is admitted and it admits too).
--   The plan, two bytes a number: per request its number of checks (at least one), and per
--     check: spec index, counter key index, and (only when the spec has a lock-out) lock
--     key index. A run of R consecutive requests (R >= 2) that are each one check of the
--     same spec, without a lock-out, on the same counter key, is one entry: 0, the spec
--     index, the key index, R. The script decides them in order with the key's state in
--     locals (a busy client's requests come in runs).
--   One binary string, not decimal arguments: Redis turns every argument into a string
--   object and a Lua string, and tonumber() would parse each with strtod, which costs
--   more than the decision itself.
-- Returns one string of little-endian doubles, per check in order: remaining (the gateway
--   truncates it to a whole count), 4 × reset_us + outcome, and then, unless the outcome is
--   0 (allowed), the time: delay_us (1 delayed) or retry_after_us (2 rejected, 3 locked).
--   A run of a token bucket's or a fixed window's requests is two numbers whatever its
--   length, what its first request sees (tokens, or room left in the window) and how many
--   of its requests are admitted (the first ones), and for a window a third, its reset.
--   Times are capped at 2^50 µs (35 years), so that 4 × reset + outcome stays exact in a
--   double. One string, not an array of integers: the gateway's RESP parser pays for
--   every element, while Redis writes either at the same cost. Two numbers for an
--   admitted check, not three, for the same reason.
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
-- What a call costs before its first decision counts too: every function and table made
-- here is made again on every call, and Lua's garbage collector then sweeps it. So there
-- are ten functions (three readers, four evaluators, whole, write and, for the reply,
-- packed), each made before the locals it does not capture (finding a captured local walks the list of those
-- captured before it), the tables of multi-use keys, locks and multi-check requests are
-- made only by calls that have them, and the common request (one check, no lock-out)
-- calls no function of ours but its algorithm's reader and evaluator and, for a key no
-- other check uses, write.
--
-- Stored state: fixed_window is a plain counter (written when its window starts, INCRBY
-- after); the others are ':' and then their numbers as little-endian doubles, exact:
-- index, current, previous (sliding_window, 25 bytes); tokens, updated (token_bucket, 17
-- bytes); tat, step (leaky_bucket, 17 bytes). struct.unpack reads them in one call, where
-- text would take a pattern match and a strtod per number. Any other value (none is
-- written) reads as no state: the key starts afresh.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local floor, ceil, max, min, abs = math.floor, math.ceil, math.max, math.min, math.abs
local byte, pack_bytes, unpack_bytes = string.byte, struct.pack, struct.unpack

-- The live state of counters used by more than one check of the batch, once a check has
-- changed them: up to three numbers per key index (made only when the batch has such keys).
local s1, s2, s3

-- Each algorithm has a reader and an evaluator. The reader takes a counter's index and its
-- stored text (false: no state; true: the live state above) and returns the state's three
-- numbers (nil when there is none). The evaluator takes those and a spec's a, b, c and
-- cost, and returns: admitted, delay, remaining_after, remaining_before, reset,
-- retry_after, and the state to keep when the request is admitted (three numbers, which
-- the next request on the key gets from the reader, and its lifetime in ms). Lifetimes
-- are ceil(µs / 1000) of a positive time, so at least 1 ms.

-- Fixed window: count, the window's end, and 1 when the window exists in Redis (nil: no
-- window yet; it starts with its first admission).
local function read_fixed(k, text)
  if text == true then return s1[k], s2[k], s3[k] end
  if not text then return nil end
  local pttl = redis.call('PTTL', KEYS[k])
  -- The key outlives its window by up to 2 ms (its expiry was rounded up to the
  -- millisecond, and PTTL counts from the current millisecond's start): the evaluator caps
  -- the window's end at `window` from now.
  if pttl > 0 then return tonumber(text), now + pttl * 1000, 1 end
  return nil, nil, 0
end

local function fixed_window(count, window_end, exists, limit, window, _, cost)
  count = count or 0
  if not window_end or window_end > now + window then window_end = now + window end
  local reset = window_end - now
  local admitted = count + cost <= limit
  local after, retry = count, reset
  if admitted then after, retry = count + cost, 0 end
  local left_after, left_before = limit - after, limit - count
  if left_after < 0 then left_after = 0 end
  if left_before < 0 then left_before = 0 end
  return admitted, 0, left_after, left_before, reset, retry, after, window_end, exists or 0, ceil(window / 1000)
end

-- Sliding window: the window's index, its count, and the previous window's count.
local function read_sliding(k, text)
  if text == true then return s1[k], s2[k], s3[k] end
  if text and byte(text) == 58 then return unpack_bytes('<ddd', text, 2) end
  return nil -- no state, or none this script wrote
end

local function sliding_window(i, current, previous, limit, window, _, cost)
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
  local left_after, left_before = max(0, floor(limit - (previous * weight + after))), max(0, floor(limit - estimate))
  return admitted, 0, left_after, left_before, window - into, retry, index, after, previous,
    ceil((2 * window - into) / 1000)
end

-- Buckets: tokens and updated (token bucket), or tat and step (leaky bucket).
local function read_bucket(k, text)
  if text == true then return s1[k], s2[k] end
  if text and #text == 17 then return unpack_bytes('<dd', text, 2) end
  return nil -- no state, or none this script wrote
end

local function token_bucket(saved, updated, _, rate, per, burst, cost)
  -- Written without min/max/floor calls: this runs for nearly every decision. The counts
  -- returned are never negative, so the gateway's truncation to whole counts floors them.
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

local function leaky_bucket(saved_tat, saved_step, _, rate, per, burst, cost)
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
    floor(new_tat + 0.5), step, 0, ceil(max(1, ceil(new_tat - now)) / 1000)
end

local readers = { read_fixed, read_sliding, read_bucket, read_bucket }
local evaluators = { fixed_window, sliding_window, token_bucket, leaky_bucket }

-- Writes: MSET arguments (key, value) and each key's expiry instant in ms.
local set_args, set_at, n_set = {}, {}, 0
local expiry_base = ceil(now / 1000) -- a state lasting d ms expires at expiry_base + d
local format = string.format

-- Whole numbers as text, each formatted once per call: expiry instants and fixed-window
-- counts repeat across keys (Lua's own number-to-string goes through "%.14g"; from 2^53
-- on, %d would go through a C long and overflow at 2^63: "%.17g" there).
local text_of = {}
local function whole(n)
  local text = text_of[n]
  if not text then
    text = format(n < 9007199254740992 and '%d' or '%.17g', n)
    text_of[n] = text
  end
  return text
end

-- Queues the write of counter k's state (a window that exists only gains `added`).
local function write(k, algorithm, v1, v2, v3, lifetime, added)
  local value
  if algorithm == 1 then
    if v3 == 1 then
      redis.call('INCRBY', KEYS[k], whole(added))
      return
    end
    value = whole(v1)
  elseif algorithm == 2 then
    value = pack_bytes('<Bddd', 58, v1, v2, v3)
  else
    value = pack_bytes('<Bdd', 58, v1, v2)
  end
  local i = n_set + 1
  set_args[2 * i - 1], set_args[2 * i], set_at[i], n_set = KEYS[k], value, expiry_base + lifetime, i
end

local call = ARGV[1]
local n_counters, n_single, n_specs, p = unpack_bytes('>HHH', call)

-- Limit specs, seven numbers each: spec s starts at index 7 × s - 6.
local spec = {}
for base = 0, 7 * n_specs - 7, 7 do
  spec[base + 1], spec[base + 2], spec[base + 3], spec[base + 4], spec[base + 5], spec[base + 6],
    spec[base + 7], p = unpack_bytes('>BdddddB', call, p)
end

-- Counter keys: their stored text, read together (false when absent), and true once the
-- live state has replaced it.
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

-- Multi-use counters: algorithm by key index once changed, the state's lifetime in ms, and
-- for fixed windows the amount admitted in this call (INCRBY'd when the window existed).
local dirty, ttl, added
if n_single < n_counters then s1, s2, s3, dirty, ttl, added = {}, {}, {}, {}, {}, {} end

local out, n_out = {}, 0
local max_time = 1125899906842624 -- 2^50 µs: see the reply above

-- Multi-check requests and lock-outs (made on first use): per check of the current
-- request, its spec's start, key, lock key and live lock, and its evaluation; and per
-- lock key, the microseconds left in its lock (false: none), read on first use.
local specs, keys, locks, locked, admitted, delays, afters, befores, resets, retries, n1, n2, n3, ttls
local lock_left

-- The spec of the last one-check request, in locals (a batch usually has one spec), with
-- its algorithm's reader and evaluator.
local current_spec, algorithm, a, b, c, cost, lockout, read, evaluate = -1

local plan_end = #call
while p < plan_end do
  local n_hi, n_lo, s_hi, s_lo, k_hi, k_lo = byte(call, p, p + 5)
  local n, s = n_hi * 256 + n_lo, 7 * (s_hi * 256 + s_lo) - 6
  if s ~= current_spec then
    current_spec, algorithm, a, b, c, cost, lockout =
      s, spec[s], spec[s + 1], spec[s + 2], spec[s + 3], spec[s + 4], spec[s + 5]
    read, evaluate = readers[algorithm], evaluators[algorithm]
  end
  if n == 1 and lockout == 0 then
    -- One check without a lock-out (the common request): nothing to stage, and a key no
    -- other check uses is written at once.
    local k = k_hi * 256 + k_lo
    p = p + 6
    local x1, x2, x3 = read(k, stored[k])
    local ok, delay, after, before, reset, retry, v1, v2, v3, lifetime = evaluate(x1, x2, x3, a, b, c, cost)
    if reset > max_time then reset = max_time end
    local o = n_out
    if not ok then
      if retry > max_time then retry = max_time end
      out[o + 1], out[o + 2], out[o + 3], n_out = before, reset * 4 + 2, retry, o + 3
    else
      if k <= n_single then
        write(k, algorithm, v1, v2, v3, lifetime, cost)
      else
        if algorithm == 1 then added[k] = (added[k] or 0) + cost end
        stored[k], s1[k], s2[k], s3[k], dirty[k], ttl[k] = true, v1, v2, v3, algorithm, lifetime
      end
      if delay > 0 then
        if delay > max_time then delay = max_time end
        out[o + 1], out[o + 2], out[o + 3], n_out = after, reset * 4 + 1, delay, o + 3
      else
        out[o + 1], out[o + 2], n_out = after, reset * 4, o + 2
      end
    end
  elseif n == 0 then
    -- A run of such requests on one key (used by more than this run, so never written at
    -- once): decided in turn with the key's state in locals, kept once at the end. The
    -- same steps as a lone request's above, which stays apart: taken through this loop as
    -- a run of one, a lone request would cost more.
    local k, r_hi, r_lo = k_hi * 256 + k_lo, byte(call, p + 6, p + 7)
    p = p + 8
    local x1, x2, x3 = read(k, stored[k])
    local admissions, lifetime, o, r = 0, 0, n_out, r_hi * 256 + r_lo
    if algorithm == 3 or algorithm == 1 then
      -- A token bucket's or a fixed window's run needs no decision of its own: its
      -- requests all see the same time, so each admitted one takes `cost` from what the one
      -- before it left (tokens, or room in the window), and once one is refused the rest
      -- are refused alike. The reply is what the first request sees (the tokens, or the
      -- room), how many the run admits and, for a window, its reset; the gateway works out
      -- each request's numbers from those exactly as the evaluator would (wire.rs).
      -- The evaluator is asked only for what the first request sees and for the state the
      -- last admission leaves, from what that request saw.
      local _, _, _, before, reset = evaluate(x1, x2, x3, a, b, c, cost)
      local left, last = before, before
      while admissions < r and left >= cost do
        last, left, admissions = left, left - cost, admissions + 1
      end
      if admissions > 0 then
        local y1, y2, y3 = last, now, 0
        if algorithm == 1 then y1, y2, y3 = (x1 or 0) + (admissions - 1) * cost, x2, x3 end
        local _, _, _, _, _, _, v1, v2, v3, life = evaluate(y1, y2, y3, a, b, c, cost)
        x1, x2, x3, lifetime = v1, v2, v3, life
      end
      out[o + 1], out[o + 2], o, r = before, admissions, o + 2, 0
      if algorithm == 1 then
        if reset > max_time then reset = max_time end
        out[o + 1], o = reset, o + 1
      end
    end
    for _ = 1, r do
      local ok, delay, after, before, reset, retry, v1, v2, v3, life = evaluate(x1, x2, x3, a, b, c, cost)
      if reset > max_time then reset = max_time end
      if not ok then
        if retry > max_time then retry = max_time end
        out[o + 1], out[o + 2], out[o + 3], o = before, reset * 4 + 2, retry, o + 3
      else
        x1, x2, x3, lifetime, admissions = v1, v2, v3, life, admissions + 1
        if delay > 0 then
          if delay > max_time then delay = max_time end
          out[o + 1], out[o + 2], out[o + 3], o = after, reset * 4 + 1, delay, o + 3
        else
          out[o + 1], out[o + 2], o = after, reset * 4, o + 2
        end
      end
    end
    n_out = o
    if admissions > 0 then
      if algorithm == 1 then added[k] = (added[k] or 0) + admissions * cost end
      stored[k], s1[k], s2[k], s3[k], dirty[k], ttl[k] = true, x1, x2, x3, algorithm, lifetime
    end
  else
    -- A request of n checks, or with a lock-out: every check is evaluated first, and the
    -- state is kept only when all of them admit.
    if not specs then
      specs, keys, locks, locked, admitted, delays, afters, befores, resets, retries, n1, n2, n3, ttls =
        {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}
      lock_left = {}
    end
    p = p + 2
    local all_admitted = true
    for i = 1, n do
      local c_hi, c_lo, ck_hi, ck_lo, l_hi, l_lo = byte(call, p, p + 5)
      local cs, k = 7 * (c_hi * 256 + c_lo) - 6, ck_hi * 256 + ck_lo
      p = p + 4
      specs[i], keys[i], locks[i], locked[i] = cs, k, false, false
      -- Negative: the lock is read, but a refusal does not start it (failure counting).
      local check_lockout = abs(spec[cs + 5])
      if check_lockout > 0 then
        local l = l_hi * 256 + l_lo
        locks[i] = l
        p = p + 2
        local left = lock_left[l]
        if left == nil then
          local pttl = redis.call('PTTL', KEYS[l])
          left = pttl > 0 and pttl * 1000
          lock_left[l] = left
        end
        -- A lock lasts `lockout`; its key may outlive it by a millisecond (see fixed_window).
        if left and left > check_lockout then left = check_lockout end
        locked[i] = left
      end
      local check_algorithm = spec[cs]
      local x1, x2, x3 = readers[check_algorithm](k, stored[k])
      admitted[i], delays[i], afters[i], befores[i], resets[i], retries[i], n1[i], n2[i], n3[i], ttls[i] =
        evaluators[check_algorithm](x1, x2, x3, spec[cs + 1], spec[cs + 2], spec[cs + 3], spec[cs + 4])
      if spec[cs + 6] ~= 1 and (locked[i] or not admitted[i]) then all_admitted = false end
    end
    for i = 1, n do
      local cs, o = specs[i], n_out
      local outcome, remaining, reset, time_left
      if locked[i] then
        outcome, remaining, reset, time_left = 3, 0, locked[i], locked[i]
      elseif not admitted[i] then
        outcome, remaining, reset, time_left = 2, befores[i], resets[i], retries[i]
        if locks[i] and spec[cs + 5] > 0 then
          -- The lock now decides when the key is free again.
          local check_lockout = spec[cs + 5]
          local lock_ms = ceil(check_lockout / 1000)
          redis.call('SET', KEYS[locks[i]], '1', 'PX', lock_ms, 'NX')
          lock_left[locks[i]] = lock_ms * 1000
          time_left, reset = max(time_left, check_lockout), max(reset, check_lockout)
        end
      elseif not all_admitted then
        outcome, remaining, reset, time_left = 0, befores[i], resets[i], 0
      else
        local k, check_algorithm, check_cost = keys[i], spec[cs], spec[cs + 4]
        if k <= n_single then
          write(k, check_algorithm, n1[i], n2[i], n3[i], ttls[i], check_cost)
        else
          if check_algorithm == 1 then added[k] = (added[k] or 0) + check_cost end
          stored[k], s1[k], s2[k], s3[k], dirty[k], ttl[k] = true, n1[i], n2[i], n3[i], check_algorithm, ttls[i]
        end
        outcome, remaining, reset, time_left = delays[i] > 0 and 1 or 0, afters[i], resets[i], delays[i]
      end
      if reset > max_time then reset = max_time end
      if outcome == 0 then
        out[o + 1], out[o + 2], n_out = remaining, reset * 4, o + 2
      else
        if time_left > max_time then time_left = max_time end
        out[o + 1], out[o + 2], out[o + 3], n_out = remaining, reset * 4 + outcome, time_left, o + 3
      end
    end
  end
end

-- One write per changed multi-use counter.
for k = n_single + 1, n_counters do
  local changed = dirty[k]
  if changed then write(k, changed, s1[k], s2[k], s3[k], ttl[k], added[k]) end
end
do
  local chunk = 500 -- key-value pairs per MSET (unpack() is bounded by Lua's C stack)
  for first = 1, n_set, chunk do
    local last = min(first + chunk - 1, n_set)
    redis.call('MSET', unpack(set_args, 2 * first - 1, 2 * last))
  end
  for i = 1, n_set do
    redis.call('PEXPIREAT', set_args[2 * i - 1], whole(set_at[i]))
  end
end
-- The reply: one string of little-endian doubles, packed 1000 at a time (unpack() is
-- bounded by Lua's C stack); a call of up to 1000 numbers (nearly all) makes no table.
local function packed(first, last)
  return pack_bytes('<' .. string.rep('d', last - first + 1), unpack(out, first, last))
end
if n_out <= 1000 then return packed(1, n_out) end
local chunks = {}
for first = 1, n_out, 1000 do chunks[#chunks + 1] = packed(first, min(first + 999, n_out)) end
return table.concat(chunks)
