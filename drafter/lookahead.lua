-- lookahead ("la"): one session's Jacobi window and n-gram pool, kept and used inside Redis.
--
-- tests/references/lookahead.py is the reference (the algorithm, worked examples); this script does the
-- same steps server-side so that a step is one round trip. Tokens are struct(">I4") each.
--
-- KEYS[1]  state hash  level, window, guess: the parameters, fixed at start
--                      levels: the window, level after level, `window` tokens each
--                      tail:   the last level-1 committed tokens (n-grams span calls)
--                      rows:   struct(">I2") per deepest-level cell of the previous tree, its
--                              row in the verifier's argmax (0 = root, 65535 = not in the tree);
--                              absent before the first tree
--                      building: the build id while the start's pieces are still arriving
-- KEYS[2]  pool hash   struct(">I4") key token -> its continuations of level-1 tokens each,
--                      most recently seen first, at most `guess` of them
-- KEYS[3]  tokens      the session's committed tokens (a record; the drafter never reads it)
--
-- ARGV  "start",    ttl_s, then a piece of the start (lookahead_store.py: start_pieces): packed
--                   prompt part, packed memory part (earlier output, learned before the prompt as
--                   a sequence of its own), memory_ends (1: the memory's last token is in this
--                   piece), build id, more (1: "continue" calls follow); then level, window, guess
--                                                                                         -> 1
--       "continue", ttl_s, the next piece of the same start, as above                         -> 1,
--                   or 0 when the session was ended or started again meanwhile (nothing done)
--       "propose",  ttl_s, packed new tokens, max_nodes, max_depth, packed argmax of the
--                   previous tree -> {{token, parent index, ...}, {score in millionths, ...}}, or
--                   nil when the session is gone or still being built. Nodes come best first
--                   (lookahead.py: scores)

local state_key, pool_key, tokens_key = KEYS[1], KEYS[2], KEYS[3]
local command, ttl_s, packed_tokens = ARGV[1], tonumber(ARGV[2]), ARGV[3]

local TOKEN_BYTES, ROW_BYTES, EXCLUDED = 4, 2, 65535
-- Node score priors, as lookahead.py; scores leave the script as integers in millionths.
local CANDIDATE_HIT, CONTINUE, WINDOW_HIT, SCORE_SCALE = 0.6, 0.8, 0.1, 1000000
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

-- A start arrives in pieces (lookahead_store.py: START_CHUNK_TOKENS), each its own call, so that
-- other sessions' calls run in between; the tail carries the n-grams across the pieces.
local build_id, more = ARGV[6], ARGV[7] == '1'
local tail = ''
if command == 'start' then
  redis.call('UNLINK', state_key, pool_key, tokens_key)
  pool_is_empty = true
  level, window, guess = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
elseif command == 'continue' then
  local state = redis.call('HMGET', state_key, 'building', 'level', 'window', 'guess', 'tail')
  if state[1] ~= build_id then return 0 end
  level, window, guess, tail = tonumber(state[2]), tonumber(state[3]), tonumber(state[4]), state[5]
end
if command == 'start' or command == 'continue' then
  ngram_bytes = (level - 1) * TOKEN_BYTES
  tail = learn(tail, ARGV[4], false)
  if ARGV[5] == '1' then tail = '' end  -- the memory does not run on into the prompt
  tail = learn(tail, packed_tokens, true)
  write_pool()
  redis.call('HSET', state_key, 'level', level, 'window', window, 'guess', guess, 'tail', tail)
  if more then
    redis.call('HSET', state_key, 'building', build_id)
  else
    -- Level 0: the root (0 until known), then prompt tokens spread evenly over the prompt.
    local count, first_level = redis.call('STRLEN', tokens_key) / TOKEN_BYTES, {struct.pack('>I4', 0)}
    for column = 1, window - 1 do
      local at = TOKEN_BYTES * math.floor(column * count / window)
      first_level[column + 1] = count > 0 and redis.call('GETRANGE', tokens_key, at, at + TOKEN_BYTES - 1)
        or struct.pack('>I4', 0)
    end
    redis.call('HSET', state_key, 'levels', table.concat(first_level))
    redis.call('HDEL', state_key, 'building')
  end
  expire_all()
  -- A long prompt leaves Lua garbage; collect it while this caller waits anyway.
  collectgarbage('collect')
  return 1
end

-- command == 'propose'
-- A session still being built is not there yet (its prompt is only partly learned).
local state = redis.call('HMGET', state_key, 'level', 'window', 'guess', 'levels', 'tail', 'rows', 'building')
if not state[1] or state[7] then return nil end
level, window, guess = tonumber(state[1]), tonumber(state[2]), tonumber(state[3])
ngram_bytes = (level - 1) * TOKEN_BYTES
local max_nodes, max_depth, argmax = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]

local levels, level_bytes = {}, window * TOKEN_BYTES
for l = 1, #state[4] / level_bytes do
  levels[l] = {}
  for j = 1, window do levels[l][j] = token_at(state[4], (l - 1) * window + j - 1) end
end

-- The verifier's outputs at the previous tree's deepest level, only when all are there: a row
-- past the end of the argmax was cut from what the gateway verified. (The argmax may also run
-- longer than the window's tree: sessions.py may append nodes of a shared memory after it.)
local outputs, rows = {}, state[6]
if not rows then outputs = nil end
for j = 1, outputs and window or 0 do
  local row = struct.unpack('>I2', rows, ROW_BYTES * (j - 1) + 1)
  if row == EXCLUDED or (row + 1) * TOKEN_BYTES > #argmax then
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

local function decay(depth)  -- CONTINUE^(depth-1), multiplied out as lookahead.py does
  local factor = 1.0
  for _ = 2, depth do factor = factor * CONTINUE end
  return factor
end

tail = learn(state[5], packed_tokens, true)
local flat, scores, deepest_rows = {}, {}, {}
if #tail > 0 then
  local root = token_at(tail, #tail / TOKEN_BYTES - 1)
  levels[1][1] = root
  -- Every node first, in discovery order (1-based ids); child_at[parent id][token] = id.
  local parent_of, token_of, depth_of, score_of, child_at = {}, {}, {}, {}, {}
  local function add(parent, token, depth, score)
    local children = child_at[parent]
    if not children then
      children = {}
      child_at[parent] = children
    end
    local at = children[token]
    if at == nil then
      at = #token_of + 1
      children[token] = at
      parent_of[at], token_of[at], depth_of[at], score_of[at] = parent, token, depth, score
    elseif score > score_of[at] then
      score_of[at] = score
    end
    return at
  end
  local candidates, weights, total = pool_entry(root), {}, 0
  for rank = 1, #candidates do
    weights[rank] = 0.5 ^ (rank - 1)
    total = total + weights[rank]
  end
  for _, candidate in ipairs(candidates) do
    local parent = 0  -- the root
    for depth = 1, math.min(level - 1, max_depth) do
      local prefix, share = string.sub(candidate, 1, TOKEN_BYTES * depth), 0
      for rank, other in ipairs(candidates) do
        if string.sub(other, 1, TOKEN_BYTES * depth) == prefix then share = share + weights[rank] end
      end
      parent = add(parent, token_at(candidate, depth - 1), depth, CANDIDATE_HIT * (share / total) * decay(depth))
    end
  end
  -- Window cells level by level; cells[l][j] is a node id, 0 the root, false: not in the tree.
  local cells = {}
  for l = 1, #levels do
    cells[l] = {}
    for j = 1, window do
      if l == 1 and j == 1 then
        cells[1][1] = 0
      else
        local parent, depth = nil, (l - 1) + (j - 1)
        if l > 1 then parent = cells[l - 1][j] else parent = cells[1][j - 1] end
        cells[l][j] = parent and depth <= max_depth and add(parent, levels[l][j], depth, WINDOW_HIT * decay(depth))
      end
    end
  end
  -- Best first: score descending, then depth, then discovery (a parent before its children).
  local order = {}
  for at = 1, #token_of do order[at] = at end
  table.sort(order, function(a, b)
    if score_of[a] ~= score_of[b] then return score_of[a] > score_of[b] end
    if depth_of[a] ~= depth_of[b] then return depth_of[a] < depth_of[b] end
    return a < b
  end)
  local index = {[0] = -1}  -- node id -> index in the tree
  for k = 1, math.min(#order, max_nodes) do
    local at = order[k]
    index[at] = k - 1
    flat[2 * k - 1], flat[2 * k] = token_of[at], index[parent_of[at]]
    scores[k] = math.floor(score_of[at] * SCORE_SCALE)
  end
  for j = 1, window do
    local at = cells[#levels][j]
    deepest_rows[j] = struct.pack('>I2', at and index[at] and index[at] + 1 or EXCLUDED)
  end
end

local packed_levels = {}
for l = 1, #levels do
  for j = 1, window do packed_levels[#packed_levels + 1] = struct.pack('>I4', levels[l][j]) end
end
write_pool()
redis.call('HSET', state_key, 'levels', table.concat(packed_levels), 'tail', tail)
if #deepest_rows > 0 then
  redis.call('HSET', state_key, 'rows', table.concat(deepest_rows))
else
  redis.call('HDEL', state_key, 'rows')
end
expire_all()
return {flat, scores}
