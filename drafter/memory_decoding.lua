-- memory_decoding: one session's n-gram trie, kept and searched inside Redis.
--
-- drafter/trie.py describes the algorithm with a worked example; this script is its server side,
-- so that each call is one round trip however long the session is.
--
-- KEYS[1]  trie hash   one field per node that can have children (path of at most branch_length
--                      tokens): struct(">I4I4") parent id, token -> struct(">I4") node id, then one
--                      entry per child, oldest first: struct(">I4I4I4I4") token, prompt count,
--                      output count, seen_at (1 + the index in KEYS[2] of that child's latest
--                      occurrence; 0: seen only in the memory, which KEYS[2] does not hold). A
--                      node's counts live in its parent's entry, so opening a node for
--                      retrieval reads one field. The root (id 0) has no field: retrieval starts
--                      one or two levels down and never needs the counts of its children.
-- KEYS[2]  tokens      the session's committed tokens, struct(">I4") each
-- KEYS[3]  state hash  branch_length; next_id; active: struct(">I4I4") parent id, token of each
--                      node whose path ends at the last token and may still grow, shortest first;
--                      with dynamic_algo (tests/references/adaptive.py): length, average, max_length and
--                      last_depth (depth of the previous tree); building: the build id while the
--                      start's pieces are still arriving; copy_at, copy_run, copy_hits,
--                      copy_trials: the copy pointer and its record (trie.py: copy)
--
-- ARGV  "start",    ttl_s, build id, more (1: "continue" calls follow), branch_length, max_length
--                   (0: no dynamic_algo), the packed prompt (KEYS[2]), next_id, active, then the
--                   first fields of the prompt's trie as field, value, field, value, ...: the
--                   drafter builds a start's trie itself (trie.py: TrieImage) and only writes it
--                   here, in pieces (trie.py: START_CHUNK_FIELDS)                            -> 1
--       "continue", ttl_s, build id, more, then the next fields of the same start             -> 1,
--                   or 0 when the session was ended or started again meanwhile (nothing done)
--       "propose",  ttl_s, packed new tokens, max_nodes, max_depth, prompt_weight, verified depth
--                   (the depth of what the gateway verified of the previous tree, for dynamic_algo;
--                   absent or -1: all of it)
--                   -> {token, parent index, token, parent index, ...}, or nil when the session is
--                   gone or still being built

local trie_key, tokens_key, state_key = KEYS[1], KEYS[2], KEYS[3]
local command, ttl_s, packed_tokens = ARGV[1], tonumber(ARGV[2]), ARGV[3]

local ROOT = 0
-- Scores (path probabilities in (0, 1]) leave the script as integers in millionths.
local SCORE_SCALE = 1000000
local TOKEN_BYTES, ID_BYTES, ENTRY_BYTES = 4, 4, 16
-- Lua 5.1's unpack() refuses more than ~8000 values, so Redis calls take slices of this size.
local SLICE = 1000

-- The part of the trie this call has touched, cached in Lua tables and written back once.
local node_at = {}           -- parent id -> {token -> node id, or false when it has no field}
local parent_of, token_of = {}, {}
local entries_of = {}        -- node id -> its packed child entries
local changed = {}           -- ids of the nodes to write back
local branch_length, next_id, active
-- Nodes from this id on were created by this call: no field of theirs is in Redis yet, so a
-- child missing from the cache does not exist.
local first_new_id = math.huge

local function field(parent, token)
  return struct.pack('>I4I4', parent, token)
end

local function hmget_sliced(fields)
  local values = {}
  for first = 1, #fields, SLICE do
    local slice = redis.call('HMGET', trie_key, unpack(fields, first, math.min(first + SLICE - 1, #fields)))
    for k = 1, #slice do values[first + k - 1] = slice[k] end
  end
  return values
end

-- Makes node_at[parents[k]][tokens[k]] known for every k, reading what is missing in one HMGET.
local function load_nodes(parents, tokens)
  local missing = {}
  for k, parent in ipairs(parents) do
    local children = node_at[parent]
    if children == nil then
      children = {}
      node_at[parent] = children
    end
    if children[tokens[k]] == nil then
      if parent >= first_new_id then children[tokens[k]] = false else missing[#missing + 1] = k end
    end
  end
  if #missing == 0 then return end
  local fields = {}
  for m, k in ipairs(missing) do fields[m] = field(parents[k], tokens[k]) end
  local values = hmget_sliced(fields)
  for m, k in ipairs(missing) do
    local parent, token, value = parents[k], tokens[k], values[m]
    if value then
      local id = struct.unpack('>I4', value)
      node_at[parent][token] = id
      parent_of[id], token_of[id] = parent, token
      entries_of[id] = string.sub(value, ID_BYTES + 1)
    else
      node_at[parent][token] = false
    end
  end
end

local function new_node(parent, token)
  local id = next_id
  next_id = next_id + 1
  node_at[parent][token] = id
  parent_of[id], token_of[id] = parent, token
  entries_of[id] = ''
  changed[id] = true
  return id
end

-- Byte offset of the entry for `token` in a packed entry list, or nil. string.find scans in C;
-- a match that is not at an entry boundary is a count that happens to hold the same bytes.
local function find_entry(entries, token)
  local needle, from = struct.pack('>I4', token), 1
  while true do
    local at = string.find(entries, needle, from, true)
    if not at or (at - 1) % ENTRY_BYTES == 0 then return at end
    from = at + 1
  end
end

local function count_child(parent, token, seen_at)
  local entries = entries_of[parent]
  local at = find_entry(entries, token)
  if at then
    local _, prompt, output, last_seen = struct.unpack('>I4I4I4I4', entries, at)
    entries_of[parent] = string.sub(entries, 1, at - 1)
      .. struct.pack('>I4I4I4I4', token, prompt, output + 1, seen_at)
      .. string.sub(entries, at + ENTRY_BYTES)
  else
    entries_of[parent] = entries .. struct.pack('>I4I4I4I4', token, 0, 1, seen_at)
  end
  changed[parent] = true
end

-- Appends committed `token` at position n (0-based): each path t[i..n], i = n - branch_length .. n,
-- ends in a node whose output count grows by one. Those nodes are the children labelled `token`
-- of the root and of the active nodes (the paths t[i..n-1]), so every (start position, depth)
-- pair is counted exactly once however the tokens arrive (TrieImage.add counts a start's tokens
-- the same way). seen_at: 1 + n.
local function add_token(token, seen_at)
  local parents = {ROOT}
  for k = 1, #active do parents[k + 1] = active[k] end
  -- The child of parents[k] is a path of k tokens; it may still grow, and so needs a field of
  -- its own, while k <= branch_length.
  local growing_parents, same_token = {}, {}
  for k = 1, math.min(#parents, branch_length) do growing_parents[k], same_token[k] = parents[k], token end
  load_nodes(growing_parents, same_token)
  for k = 2, #parents do count_child(parents[k], token, seen_at) end
  active = {}
  for k, parent in ipairs(growing_parents) do
    active[k] = node_at[parent][token] or new_node(parent, token)
  end
end

-- The tokens go on at the end of KEYS[2], which held `recorded` tokens.
local function add_tokens(packed, recorded)
  for k = 1, #packed / TOKEN_BYTES do
    add_token(struct.unpack('>I4', packed, TOKEN_BYTES * (k - 1) + 1), recorded + k)
  end
  if #packed > 0 then redis.call('APPEND', tokens_key, packed) end
end

-- Writes the changed nodes SLICE at a time: the argument strings die young.
local function write_back()
  local pairs_to_set = {}
  for id in pairs(changed) do
    pairs_to_set[#pairs_to_set + 1] = field(parent_of[id], token_of[id])
    pairs_to_set[#pairs_to_set + 1] = struct.pack('>I4', id) .. entries_of[id]
    if #pairs_to_set == 2 * SLICE then
      redis.call('HSET', trie_key, unpack(pairs_to_set))
      pairs_to_set = {}
    end
  end
  if #pairs_to_set > 0 then redis.call('HSET', trie_key, unpack(pairs_to_set)) end
  local active_fields = {}
  for k, id in ipairs(active) do active_fields[k] = field(parent_of[id], token_of[id]) end
  redis.call('HSET', state_key, 'next_id', next_id, 'active', table.concat(active_fields))
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl_s) end
end

-- A node's children as a candidate group: tokens, weights, their total, which are taken, and
-- `scale`: the parent's score times the chance that the text goes on with a continuation seen
-- before at all, total / (total + distinct continuations) (Witten-Bell: a context seen once
-- keeps half its mass for the unseen, one seen often keeps little). trie.py: scores.
local function children_group(id, prompt_weight, score)
  local entries = entries_of[id]
  if entries == '' then return nil end
  local group = {node = id, tokens = {}, weights = {}, total = 0, taken = {}}
  local distinct = #entries / ENTRY_BYTES
  for k = 1, distinct do
    local token, prompt, output = struct.unpack('>I4I4I4I4', entries, ENTRY_BYTES * (k - 1) + 1)
    group.tokens[k], group.weights[k] = token, prompt * prompt_weight + output
    group.total = group.total + group.weights[k]
  end
  group.scale = score * group.total / (group.total + distinct)
  return group
end

-- The group's best child not taken yet: highest weight, then lowest token.
local function best_remaining(group)
  local best
  for k, weight in ipairs(group.weights) do
    if not group.taken[k] and (not best or weight > group.weights[best]
        or (weight == group.weights[best] and group.tokens[k] < group.tokens[best])) then
      best = k
    end
  end
  return best
end

-- Best-first growth from the query node. A child's score is its group's scale times
-- weight / sibling total, never above its parent's, so the scores come out non-increasing and
-- every prefix of the result is a tree. Every group keeps its best remaining child at the
-- front, so the best frontier node is the best of the group fronts; ties go to the
-- earlier-opened group.
local function grow_tree(query_node, max_nodes, max_depth, prompt_weight)
  local flat, size, groups, deepest, scores = {}, 0, {}, 0, {}
  local function open(node, depth, score, index)
    local group = children_group(node, prompt_weight, score)
    if group then
      group.depth, group.parent_index = depth + 1, index
      group.front = best_remaining(group)
      groups[#groups + 1] = group
    end
  end
  open(query_node, 0, 1, -1)
  while size < max_nodes and #groups > 0 do
    local chosen, chosen_at, chosen_score
    for at, group in ipairs(groups) do
      local score = group.scale * group.weights[group.front] / group.total
      if not chosen or score > chosen_score then chosen, chosen_at, chosen_score = group, at, score end
    end
    local token = chosen.tokens[chosen.front]
    chosen.taken[chosen.front] = true
    chosen.front = best_remaining(chosen)
    if not chosen.front then table.remove(groups, chosen_at) end
    flat[2 * size + 1], flat[2 * size + 2] = token, chosen.parent_index
    size = size + 1
    deepest = math.max(deepest, chosen.depth)
    scores[size] = math.floor(chosen_score * SCORE_SCALE)
    if chosen.depth < max_depth and size < max_nodes then
      load_nodes({chosen.node}, {token})
      local child = node_at[chosen.node][token]
      -- a child without a field sits at the deepest level of the trie: it has no children
      if child then open(child, chosen.depth, chosen_score, size - 1) end
    end
  end
  return flat, deepest, scores
end

-- dynamic_algo, as tests/references/adaptive.py (the reference, with worked examples): the candidate
-- length follows a per-mille moving average of accepted / depth of the previous tree.
local GROW_AT, SHRINK_AT, MIN_LENGTH = 600, 300, 1
local function adapt_length(length, average, committed, last_depth, max_length)
  if last_depth <= 0 or committed <= 0 then return length, average end
  local accepted = math.min(committed - 1, last_depth)
  average = math.floor((average + math.floor(1000 * accepted / last_depth)) / 2)
  if average >= GROW_AT and length < max_length then
    length = length + 1
  elseif average <= SHRINK_AT and length > MIN_LENGTH then
    length = length - 1
  end
  return length, average
end

-- The active nodes stored in the state, loaded: the paths that the next token continues.
local function load_active(packed_active)
  local parents, tokens, field_bytes = {}, {}, ID_BYTES + TOKEN_BYTES
  for k = 1, #packed_active / field_bytes do
    parents[k], tokens[k] = struct.unpack('>I4I4', packed_active, field_bytes * (k - 1) + 1)
  end
  load_nodes(parents, tokens)
  active = {}
  for k, parent in ipairs(parents) do active[k] = node_at[parent][tokens[k]] end
end

-- copy, as trie.py describes it: a pointer into KEYS[2] at the token that the text would write
-- next if it goes on copying the stretch it has been following. A prior of 2 hits in 3 trials,
-- and the record halves once it holds COPY_WINDOW trials, so that it follows a change of regime.
local COPY_PRIOR_HITS, COPY_PRIOR_TRIALS, COPY_WINDOW = 2, 3, 64

-- `count` tokens of KEYS[2] from index `first` (0-based).
local function read_tokens(first, count)
  if count <= 0 then return {} end
  local packed = redis.call('GETRANGE', tokens_key, TOKEN_BYTES * first, TOKEN_BYTES * (first + count) - 1)
  local tokens = {}
  for k = 1, #packed / TOKEN_BYTES do tokens[k] = struct.unpack('>I4', packed, TOKEN_BYTES * (k - 1) + 1) end
  return tokens
end

-- Checks the pointer against the committed tokens, one trial each until the first miss (which
-- drops the pointer): its record is exactly how often the copy's next token was right.
local function follow_copy(copy, packed)
  if copy.at < 0 then return end
  local source = read_tokens(copy.at, #packed / TOKEN_BYTES)
  for k, expected in ipairs(source) do
    copy.trials = copy.trials + 1
    if struct.unpack('>I4', packed, TOKEN_BYTES * (k - 1) + 1) ~= expected then
      copy.at, copy.run = -1, 0
      break
    end
    copy.at, copy.run, copy.hits = copy.at + 1, copy.run + 1, copy.hits + 1
  end
  while copy.trials >= COPY_WINDOW do
    copy.hits, copy.trials = math.floor(copy.hits / 2), math.floor(copy.trials / 2)
  end
end

-- Moves the pointer behind the latest earlier occurrence of the longest suffix that went on
-- before (active[k] is the path of the last k tokens), unless the pointer already follows a
-- match at least that long: O(branch_length) entries, no scan of the tokens.
local function anchor_copy(copy)
  for k = #active, copy.run + 1, -1 do
    local entries, latest = entries_of[active[k]], 0
    for at = ENTRY_BYTES - 3, #entries, ENTRY_BYTES do
      latest = math.max(latest, (struct.unpack('>I4', entries, at)))
    end
    if latest > 0 then
      copy.at, copy.run = latest - 1, k
      return
    end
  end
end

-- The pointer's chain, each node scored r^depth, r = the record's hit rate. Past the end of the
-- record it goes on from its own first token: a text that keeps copying what it wrote `period`
-- tokens back writes those tokens again and again (a loop), so the chain is periodic.
local function copy_chain(copy, recorded, max_nodes, max_depth)
  local period = recorded - copy.at
  if copy.at < 0 or period <= 0 then return {}, {} end
  local length = math.min(max_nodes, max_depth)
  local chain = read_tokens(copy.at, math.min(length, period))
  for k = #chain + 1, length do chain[k] = chain[k - period] end
  local rate = (copy.hits + COPY_PRIOR_HITS) / (copy.trials + COPY_PRIOR_TRIALS)
  local chain_scores, score = {}, 1
  for k = 1, #chain do
    score = score * rate
    chain_scores[k] = math.floor(score * SCORE_SCALE)
  end
  return chain, chain_scores
end

-- The union of the trie's tree and the chain (a node is its path, its score the higher one),
-- best max_nodes first by (score, depth, count tree's order then the chain's): as
-- runtime/trees.py's merge_trees. A child never scores above its parent in either tree, nor
-- so in the union, and ranks after it: every prefix is still a tree.
local function merge_chain(flat, scores, chain, chain_scores, max_nodes)
  local nodes = {}
  for i = 1, #scores do
    local parent = flat[2 * i] + 1  -- 0: the query node
    nodes[i] = {token = flat[2 * i - 1], parent = parent, score = scores[i],
      depth = parent > 0 and nodes[parent].depth + 1 or 1, order = i}
  end
  local parent, inside = 0, true
  for k, token in ipairs(chain) do
    local match
    if inside then
      for i = 1, #scores do
        if nodes[i].parent == parent and nodes[i].token == token then match = i break end
      end
    end
    if match then
      nodes[match].score = math.max(nodes[match].score, chain_scores[k])
    else
      inside, match = false, #nodes + 1
      nodes[match] = {token = token, parent = parent, score = chain_scores[k], depth = k, order = match}
    end
    parent = match
  end
  local ranked = {}
  for i = 1, #nodes do ranked[i] = i end
  table.sort(ranked, function(a, b)
    local x, y = nodes[a], nodes[b]
    if x.score ~= y.score then return x.score > y.score end
    if x.depth ~= y.depth then return x.depth < y.depth end
    return x.order < y.order
  end)
  local merged_flat, merged_scores, index_of, deepest = {}, {}, {[0] = 0}, 0
  for rank = 1, math.min(max_nodes, #ranked) do
    local node = nodes[ranked[rank]]
    index_of[ranked[rank]] = rank
    merged_flat[2 * rank - 1], merged_flat[2 * rank] = node.token, index_of[node.parent] - 1
    merged_scores[rank] = node.score
    deepest = math.max(deepest, node.depth)
  end
  return merged_flat, deepest, merged_scores
end

-- A start arrives in pieces, each its own call, so that other sessions' calls run in between;
-- the first writes the state and the tokens, every piece its share of the trie's fields.
if command == 'start' or command == 'continue' then
  local build_id, more, first_field = ARGV[3], ARGV[4] == '1', 5
  if command == 'start' then
    redis.call('UNLINK', trie_key, tokens_key, state_key)  -- freed in the background: no stall
    redis.call('HSET', state_key, 'branch_length', ARGV[5], 'next_id', ARGV[8], 'active', ARGV[9])
    local max_length = tonumber(ARGV[6])
    if max_length > 0 then
      redis.call('HSET', state_key, 'length', math.min(3, max_length), 'average', 500,
        'max_length', max_length, 'last_depth', 0)
    end
    if #ARGV[7] > 0 then redis.call('SET', tokens_key, ARGV[7]) end
    first_field = 10
  elseif redis.call('HGET', state_key, 'building') ~= build_id then
    return 0
  end
  if #ARGV >= first_field then redis.call('HSET', trie_key, unpack(ARGV, first_field, #ARGV)) end
  if more then
    redis.call('HSET', state_key, 'building', build_id)
  else
    redis.call('HDEL', state_key, 'building')
  end
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl_s) end
  return 1
end

-- command == 'propose'
-- A session still being built is not there yet: its trie is only partly written, and
-- appending output tokens in between would break it.
local state = redis.call('HMGET', state_key, 'branch_length', 'next_id', 'active', 'building',
  'copy_at', 'copy_run', 'copy_hits', 'copy_trials')
if not state[1] or state[4] then return nil end
branch_length, next_id = tonumber(state[1]), tonumber(state[2])
first_new_id = next_id
load_active(state[3])
for k = 1, #state[3] / (ID_BYTES + TOKEN_BYTES) do
  if not active[k] then return nil end  -- its trie was evicted (the caller ends the session)
end

local max_nodes, max_depth, prompt_weight = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local recorded = redis.call('STRLEN', tokens_key) / TOKEN_BYTES
add_tokens(packed_tokens, recorded)
recorded = recorded + #packed_tokens / TOKEN_BYTES
local copy = {at = tonumber(state[5] or -1), run = tonumber(state[6] or 0), hits = tonumber(state[7] or 0),
  trials = tonumber(state[8] or 0)}
follow_copy(copy, packed_tokens)
anchor_copy(copy)
redis.call('HSET', state_key, 'copy_at', copy.at, 'copy_run', copy.run, 'copy_hits', copy.hits,
  'copy_trials', copy.trials)
write_back()
local dynamic = redis.call('HMGET', state_key, 'length', 'average', 'max_length', 'last_depth')
if dynamic[1] then
  -- The gateway may verify a prefix of the tree, or none of it: the hit ratio is measured
  -- against the depth it did verify.
  local verified_depth = tonumber(ARGV[7] or -1)
  local last_depth = verified_depth >= 0 and math.min(verified_depth, tonumber(dynamic[4])) or tonumber(dynamic[4])
  local length, average = adapt_length(tonumber(dynamic[1]), tonumber(dynamic[2]),
    #packed_tokens / TOKEN_BYTES, last_depth, tonumber(dynamic[3]))
  max_nodes = math.min(max_nodes, length)
  redis.call('HSET', state_key, 'length', length, 'average', average)
end
local flat, deepest, scores = {}, 0, {}
if max_nodes > 0 and max_depth > 0 and #active > 0 then
  -- Query with the last two tokens (active[2] is the path [a, b]); when that path has never
  -- been continued, with the last token alone.
  local query_node = active[1]
  if active[2] and entries_of[active[2]] ~= '' then query_node = active[2] end
  flat, deepest, scores = grow_tree(query_node, max_nodes, max_depth, prompt_weight)
  local chain, chain_scores = copy_chain(copy, recorded, max_nodes, max_depth)
  if #chain > 0 then flat, deepest, scores = merge_chain(flat, scores, chain, chain_scores, max_nodes) end
end
if dynamic[1] then redis.call('HSET', state_key, 'last_depth', deepest) end
-- Redis keeps only the first value; sessions.lua, which wraps this script, uses all three to
-- merge in a shared memory's tree by score under the same node budget.
return flat, scores, max_nodes
