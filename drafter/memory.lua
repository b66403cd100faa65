-- Drafting memories that outlive a session; drafter/memory.py is the reference and the doc.
--
-- "append"  KEYS[1] a conversation's earlier output (string of struct(">I4") tokens)
--           ARGV: packed tokens, most tokens kept, ttl_s                                -> 1
-- "learn"   KEYS[1] contexts hash: struct(">I4I4") two tokens -> entries, best first, each
--                   struct(">I4I4") count, length, then `length` tokens that followed them
--           KEYS[2] recency sorted set: context field -> clock of its last update
--           KEYS[3] clock (a counter: one tick per learn)
--           ARGV: packed tokens, branch_length, max_entries, max_contexts, count_cap, ttl_s,
--                 contexts (how many to count, from the first; the tokens after them are
--                 continuations only)                               -> contexts evicted

local command = ARGV[1]

if command == 'append' then
  local key, packed, max_tokens, ttl_s = KEYS[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
  local length = redis.call('APPEND', key, packed)
  if length > 4 * max_tokens then
    redis.call('SET', key, redis.call('GETRANGE', key, length - 4 * max_tokens, -1))
  end
  redis.call('EXPIRE', key, ttl_s)
  return 1
end

-- command == 'learn'
local contexts_key, recency_key, clock_key = KEYS[1], KEYS[2], KEYS[3]
local packed, branch_length = ARGV[2], tonumber(ARGV[3])
local max_entries, max_contexts, count_cap, ttl_s = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local clock = redis.call('INCR', clock_key)

local cache = {}  -- context field -> {{count, tokens}, ...}

local function entries_of(field)
  local entries = cache[field]
  if entries then return entries end
  entries = {}
  local value, at = redis.call('HGET', contexts_key, field), 1
  while value and at <= #value do
    local count, length = struct.unpack('>I4I4', value, at)
    entries[#entries + 1] = {count, string.sub(value, at + 8, at + 7 + 4 * length)}
    at = at + 8 + 4 * length
  end
  cache[field] = entries
  return entries
end

-- As update_entries in memory.py: count the continuation (one that extends or is extended by
-- it is the same evidence), keep entries by count then most recent first, halve all counts
-- past the cap, drop the worst beyond max_entries.
local function update(entries, continuation)
  local found
  for k, entry in ipairs(entries) do
    local stored = entry[2]
    if string.sub(stored, 1, #continuation) == continuation or string.sub(continuation, 1, #stored) == stored then
      found = table.remove(entries, k)
      found[1] = found[1] + 1
      if #continuation > #stored then found[2] = continuation end
      break
    end
  end
  found = found or {1, continuation}
  local at = #entries + 1
  for k, entry in ipairs(entries) do
    if entry[1] <= found[1] then
      at = k
      break
    end
  end
  table.insert(entries, at, found)
  if found[1] > count_cap then
    for _, entry in ipairs(entries) do entry[1] = math.max(1, math.floor(entry[1] / 2)) end
  end
  while #entries > max_entries do table.remove(entries) end
end

local count = #packed / 4
for i = 2, math.min(count, 2 + tonumber(ARGV[8])) - 1 do  -- 0-based context tokens i-2, i-1; continuation from i
  local field = string.sub(packed, 4 * (i - 2) + 1, 4 * i)
  update(entries_of(field), string.sub(packed, 4 * i + 1, 4 * math.min(i + branch_length, count)))
end

for field, entries in pairs(cache) do
  local parts = {}
  for k, entry in ipairs(entries) do parts[k] = struct.pack('>I4I4', entry[1], #entry[2] / 4) .. entry[2] end
  redis.call('HSET', contexts_key, field, table.concat(parts))
  redis.call('ZADD', recency_key, clock, field)
end

-- Least recently updated contexts go first once there are too many.
local excess = redis.call('ZCARD', recency_key) - max_contexts
if excess > 0 then
  local victims = redis.call('ZRANGE', recency_key, 0, excess - 1)
  redis.call('ZREMRANGEBYRANK', recency_key, 0, excess - 1)
  for first = 1, #victims, 1000 do
    redis.call('HDEL', contexts_key, unpack(victims, first, math.min(first + 999, #victims)))
  end
end
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl_s) end
return math.max(excess, 0)
