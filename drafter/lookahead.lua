-- lookahead ("la"): one session's Jacobi window and n-gram pool, kept and used inside Redis.
--
-- drafter/lookahead.py is the reference (the algorithm, worked examples); this script does the
-- same steps server-side so that a step is one round trip. Tokens are struct(">I4") each.
--
-- KEYS[1]  state hash  level, window, guess: the parameters, fixed at start
--                      levels: the window, level after level, `window` tokens each
--                      tail:   the last level-1 committed tokens (n-grams span calls)
--                      rows:   struct(">I2") per deepest-level cell of the previous tree, its
--                              row in the verifier's argmax (0 = root, 65535 = not in the tree);
--                              absent before the first tree
--                      nodes:  node count of the previous tree
-- KEYS[2]  pool hash   struct(">I4") key token -> its continuations of level-1 tokens each,
--                      most recently seen first, at most `guess` of them
-- KEYS[3]  tokens      the session's committed tokens (a record; the drafter never reads it)
--
-- ARGV  "start",   ttl_s, packed prompt, level, window, guess, packed memory tokens (earlier
--                  output, learned before the prompt as a sequence of its own)          -> 1
--       "propose", ttl_s, packed new tokens, max_nodes, max_depth, packed argmax of the
--                  previous tree -> {token, parent index, ...}, or nil when the session is gone

local state_key, pool_key, tokens_key = KEYS[1], KEYS[2], KEYS[3]
local command, ttl_s, packed_tokens = ARGV[1], tonumber(ARGV[2]), ARGV[3]

local TOKEN_BYTES, ROW_BYTES, EXCLUDED = 4, 2, 65535
-- Lua 5.1's unpack() refuses more than ~8000 values, so HSET takes slices of this many pairs.
local SLICE = 1000

local level, window, guess, ngram_bytes
local pool = {}          -- key token -> {packed continuation, ...}, the entries this call touched
local pool_changed = {}  -- key tokens to write back
local pool_is_empty = false

local function token_at(packed, index)  -- 0-based index
  return (struct.unpack('>I4', packed, TOKEN_BYTES * index + 1))
end

local function pool_entry(key)
  local entry = pool[key]
  if entry then return entry end
  entry = {}
  local value = not pool_is_empty and redis.call('HGET', pool_key, struct.pack('>I4', key))
  if value then
    for k = 1, #value / ngram_bytes do entry[k] = string.sub(value, (k - 1) * ngram_bytes + 1, k * ngram_bytes) end
  end
  pool[key] = entry
  return entry
end

-- `ngram` (packed) followed `key` just now: to the front; the least recently seen falls off.
local function add_to_pool(key, ngram)
  local entry = pool_entry(key)
  for k = 1, #entry do
    if entry[k] == ngram then
      table.remove(entry, k)
      break
    end
  end
  table.insert(entry, 1, ngram)
  entry[guess + 1] = nil
  pool_changed[key] = true
end

-- Learns every n-gram of tail .. new tokens (each holds a new token: the tail is level-1
-- long) and returns the new tail. Continuations are substrings: no unpacking needed.
local function learn(tail, packed, record)
  local sequence = tail .. packed
  local count = #sequence / TOKEN_BYTES
  for i = 0, count - level do
    add_to_pool(token_at(sequence, i), string.sub(sequence, TOKEN_BYTES * (i + 1) + 1, TOKEN_BYTES * (i + level)))
  end
  if record and #packed > 0 then redis.call('APPEND', tokens_key, packed) end
  return string.sub(sequence, math.max(1, #sequence - ngram_bytes + 1))
end

local function write_pool()
  local pairs_to_set = {}
  for key in pairs(pool_changed) do
    pairs_to_set[#pairs_to_set + 1] = struct.pack('>I4', key)
    pairs_to_set[#pairs_to_set + 1] = table.concat(pool[key])
    if #pairs_to_set == 2 * SLICE then
      redis.call('HSET', pool_key, unpack(pairs_to_set))
      pairs_to_set = {}
    end
  end
  if #pairs_to_set > 0 then redis.call('HSET', pool_key, unpack(pairs_to_set)) end
end

local function expire_all()
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl_s) end
end

if command == 'start' then
  redis.call('DEL', state_key, pool_key, tokens_key)
  pool_is_empty = true
  level, window, guess = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
  ngram_bytes = (level - 1) * TOKEN_BYTES
  -- Level 0: the root (0 until known), then prompt tokens spread evenly over the prompt.
  local count, first_level = #packed_tokens / TOKEN_BYTES, {struct.pack('>I4', 0)}
  for column = 1, window - 1 do
    local token = count > 0 and token_at(packed_tokens, math.floor(column * count / window)) or 0
    first_level[column + 1] = struct.pack('>I4', token)
  end
  learn('', ARGV[7] or '', false)
  local tail = learn('', packed_tokens, true)
  write_pool()
  redis.call('HSET', state_key, 'level', level, 'window', window, 'guess', guess,
    'levels', table.concat(first_level), 'tail', tail, 'nodes', 0)
  expire_all()
  -- A long prompt leaves Lua garbage; collect it while this caller waits anyway.
  collectgarbage('collect')
  return 1
end

-- command == 'propose'
local state = redis.call('HMGET', state_key, 'level', 'window', 'guess', 'levels', 'tail', 'rows', 'nodes')
if not state[1] then return nil end
level, window, guess = tonumber(state[1]), tonumber(state[2]), tonumber(state[3])
ngram_bytes = (level - 1) * TOKEN_BYTES
local max_nodes, max_depth, argmax = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]

local levels, level_bytes = {}, window * TOKEN_BYTES
for l = 1, #state[4] / level_bytes do
  levels[l] = {}
  for j = 1, window do levels[l][j] = token_at(state[4], (l - 1) * window + j - 1) end
end

-- The verifier's outputs at the previous tree's deepest level, only when all are there.
local outputs, rows, nodes = {}, state[6], tonumber(state[7])
-- The argmax may run longer than the window's tree: sessions.py may append nodes of a shared
-- memory after it.
if not rows or #argmax < (nodes + 1) * TOKEN_BYTES then outputs = nil end
for j = 1, outputs and window or 0 do
  local row = struct.unpack('>I2', rows, ROW_BYTES * (j - 1) + 1)
  if row == EXCLUDED then
    outputs = nil
    break
  end
  outputs[j] = token_at(argmax, row)
end

if outputs then
  if #levels == level - 1 then  -- full: harvest column n-grams, then drop level 0
    for j = 1, window do
      local ngram = {}
      for l = 2, #levels do ngram[l - 1] = struct.pack('>I4', levels[l][j]) end
      ngram[#ngram + 1] = struct.pack('>I4', outputs[j])
      add_to_pool(levels[1][j], table.concat(ngram))
    end
    table.remove(levels, 1)
  end
  levels[#levels + 1] = outputs
end

local tail = learn(state[5], packed_tokens, true)
local flat, deepest_rows = {}, {}
if #tail > 0 then
  local root = token_at(tail, #tail / TOKEN_BYTES - 1)
  levels[1][1] = root
  local size, child_at = 0, {}  -- child_at[parent index][token] = node index
  local function add(parent, token)
    local children = child_at[parent]
    if not children then
      children = {}
      child_at[parent] = children
    end
    local at = children[token]
    if at == nil and size < max_nodes then
      at, size = size, size + 1
      children[token] = at
      flat[2 * at + 1], flat[2 * at + 2] = token, parent
    end
    return at
  end
  for _, candidate in ipairs(pool_entry(root)) do
    local parent = -1
    for k = 0, math.min(level - 1, max_depth) - 1 do
      parent = add(parent, token_at(candidate, k))
      if parent == nil then break end
    end
  end
  -- Window cells level by level; cells[l][j] is a node index, -1 the root, false: not in the tree.
  local cells = {}
  for l = 1, #levels do
    cells[l] = {}
    for j = 1, window do
      if l == 1 and j == 1 then
        cells[1][1] = -1
      else
        local parent
        if l > 1 then parent = cells[l - 1][j] else parent = cells[1][j - 1] end
        local at = parent and (l - 1) + (j - 1) <= max_depth and add(parent, levels[l][j])
        cells[l][j] = at ~= nil and at
      end
    end
  end
  for j = 1, window do
    local at = cells[#levels][j]
    deepest_rows[j] = struct.pack('>I2', at and at + 1 or EXCLUDED)
  end
  nodes = size
else
  nodes = 0
end

local packed_levels = {}
for l = 1, #levels do
  for j = 1, window do packed_levels[#packed_levels + 1] = struct.pack('>I4', levels[l][j]) end
end
write_pool()
redis.call('HSET', state_key, 'levels', table.concat(packed_levels), 'tail', tail, 'nodes', nodes)
if #deepest_rows > 0 then
  redis.call('HSET', state_key, 'rows', table.concat(deepest_rows))
else
  redis.call('HDEL', state_key, 'rows')
end
expire_all()
return flat
