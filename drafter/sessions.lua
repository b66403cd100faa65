-- Dispatcher: one script for every session, whatever its algorithm, so that a step stays one
-- round trip although ProposeRequest does not say which algorithm the session uses.
-- drafter/sessions.py prepends memory_decoding.lua and lookahead.lua to this text, each wrapped
-- as `local function memory_decoding(KEYS, ARGV) ... end` (and `lookahead`).
--
-- KEYS[1]     meta hash  algorithm; prompt_length; conversation and shared (memory names, may
--                        be empty): what EndSession needs to hand the output to the memories;
--                        proposed_at, proposed: the committed length of the last propose that
--                        said one, and its reply (cjson), which a repeat of it gets again
-- KEYS[2..4]  memory_decoding's trie, tokens, state
-- KEYS[5..6]  lookahead's state, pool (its tokens key is KEYS[3] as well)
--
-- ARGV "start", ttl_s, algorithm, prompt length, conversation, shared, then what the
--              algorithm's own "start" takes after ttl_s: the first piece of the prompt and
--              memory, then its parameters                                              -> 1
--      "continue", ttl_s, the next piece, as the algorithm's own "continue" takes it  -> 1, or 0
--              when the session was ended or started again meanwhile. Until the last piece is
--              in, the algorithm's propose finds no session (returns nil).
--      "propose", ttl_s, packed new tokens, max_nodes, max_depth, packed argmax, prompt_weight,
--              verified depth (memory_decoding's dynamic_algo; -1: the whole previous tree),
--              committed length (-1: not said)
--              -> {flat tree, node scores (millionths, best first), node budget used,
--                  shared memory name or false, the last two committed tokens packed, algorithm},
--                 or nil when the session is gone (or still being built), or an error reply
--                 "committed_length ..." when the length follows neither rule below
--
-- Idempotent propose. The committed length is how many tokens the session's text (prompt and
-- every committed token; KEYS[3]) holds once the call's new tokens are in: the call's key. A
-- call whose length equals both what KEYS[3] holds and the last keyed propose's is a repeat
-- (a retry of a call that did its work but whose reply was lost): it gets that call's reply
-- again, cut to its max_nodes and max_depth, and changes nothing (no token recorded, no n-gram learned, no
-- window moved, no dynamic_algo update). Otherwise the length must be what KEYS[3] holds plus
-- the new tokens, or less by a head of the new tokens that KEYS[3] already ends with: a caller
-- that never heard back from a call resends its tokens with the next, and those the lost call
-- recorded are skipped. Anything else (a stale duplicate arriving after later calls, or a
-- caller that lost count) is refused, changing nothing.
--      "end", ttl_s, packed tokens committed since the last propose
--              -> {packed output tokens, those included, conversation, shared, the last two
--                  prompt tokens packed} (false when unknown); deletes all. The trie is about to
--                 go, so the last tokens only join the outputs (the memories' input).

local meta_key = KEYS[1]
local md_keys = {KEYS[2], KEYS[3], KEYS[4]}
local la_keys = {KEYS[5], KEYS[6], KEYS[3]}
local command, ttl_s = ARGV[1], ARGV[2]

if command == 'start' then
  -- UNLINK, not DEL: a long session's trie is freed in the background (DEL of a 32k-token
  -- trie held Redis for ~65 ms).
  redis.call('UNLINK', unpack(KEYS))
  local algorithm = ARGV[3]
  local start_argv = {'start', ttl_s, unpack(ARGV, 7)}
  if algorithm == 'la' then lookahead(la_keys, start_argv) else memory_decoding(md_keys, start_argv) end
  redis.call('HSET', meta_key, 'algorithm', algorithm, 'prompt_length', ARGV[4],
    'conversation', ARGV[5], 'shared', ARGV[6])
  redis.call('EXPIRE', meta_key, ttl_s)
  return 1
end

if command == 'continue' then
  local algorithm = redis.call('HGET', meta_key, 'algorithm')
  if not algorithm then return 0 end
  local done
  if algorithm == 'la' then done = lookahead(la_keys, ARGV) else done = memory_decoding(md_keys, ARGV) end
  redis.call('EXPIRE', meta_key, ttl_s)
  return done
end

if command == 'propose' then
  local meta = redis.call('HMGET', meta_key, 'algorithm', 'shared', 'proposed_at', 'proposed', 'prompt_length')
  if not meta[1] then return nil end
  local shared = meta[2] ~= '' and meta[2]
  local committed = tonumber(ARGV[9] or -1)
  local state_key = meta[1] == 'la' and KEYS[5] or KEYS[4]
  local recorded = redis.call('STRLEN', KEYS[3]) / 4
  local state = redis.call('HMGET', state_key, 'building', meta[1] == 'la' and 'level' or 'branch_length')
  if state[1] then return nil end  -- not there yet: its start's pieces are still arriving
  -- Redis evicts a session's keys one by one (maxmemory, volatile-lru): one whose state or text
  -- went is gone as a whole, not a session to go on with.
  if not state[2] or recorded < tonumber(meta[5] or 0) then
    redis.call('UNLINK', unpack(KEYS))
    return nil
  end
  if committed >= 0 then
    if committed == recorded and tonumber(meta[3]) == committed then
      local new = ARGV[3]
      if #new > 0 and redis.call('GETRANGE', KEYS[3], -#new, -1) ~= new then
        return redis.error_reply('committed_length: ' .. committed .. ' repeats the last call, but its'
          .. ' new tokens are not the ones that call recorded (a repeat carries the same new_token_ids)')
      end
      -- Its tree cut to this call's max_nodes and max_depth: the longest head of it within both
      -- (a head keeps every node's index, which lookahead's window rows refer to).
      local last = cjson.decode(meta[4])
      local max_nodes, max_depth = tonumber(ARGV[4]), tonumber(ARGV[5])
      local flat, scores, depth = {}, {}, {}
      for k = 1, math.min(max_nodes, #last[2]) do
        local parent = last[1][2 * k]
        depth[k] = parent < 0 and 1 or depth[parent + 1] + 1
        if depth[k] > max_depth then break end
        flat[2 * k - 1], flat[2 * k], scores[k] = last[1][2 * k - 1], parent, last[2][k]
      end
      return {flat, scores, math.min(max_nodes, last[3]), shared,
        shared and redis.call('GETRANGE', KEYS[3], -8, -1) or '', meta[1]}
    end
    -- New tokens the text already ends with came in a call that got through unheard: skipped.
    local new_count = #ARGV[3] / 4
    local held = recorded + new_count - committed
    if held < 0 or held > new_count or (held > 0
        and string.sub(ARGV[3], 1, 4 * held) ~= redis.call('GETRANGE', KEYS[3], -4 * held, -1)) then
      return redis.error_reply('committed_length: ' .. committed .. ' is neither the ' .. recorded
        .. ' tokens the session holds (a repeat of its last call) nor those and the '
        .. new_count .. ' new ones, less those of them it already ends with (a stale call, or one'
        .. ' that lost count)')
    end
    if held > 0 then ARGV[3] = string.sub(ARGV[3], 4 * held + 1) end
  end
  local flat, scores, budget
  if meta[1] == 'la' then
    local reply = lookahead(la_keys, {'propose', ttl_s, ARGV[3], ARGV[4], ARGV[5], ARGV[6]})
    if reply then flat, scores, budget = reply[1], reply[2], tonumber(ARGV[4]) end
  else
    flat, scores, budget = memory_decoding(md_keys,
      {'propose', ttl_s, ARGV[3], ARGV[4], ARGV[5], ARGV[7], ARGV[8]})
  end
  if not flat then  -- part of the session was evicted (its trie): it is gone as a whole
    redis.call('UNLINK', unpack(KEYS))
    return nil
  end
  if committed >= 0 then
    redis.call('HSET', meta_key, 'proposed_at', committed, 'proposed', cjson.encode({flat, scores, budget}))
  end
  redis.call('EXPIRE', meta_key, ttl_s)
  return {flat, scores, budget, shared, shared and redis.call('GETRANGE', KEYS[3], -8, -1) or '', meta[1]}
end

-- command == 'end'
local meta = redis.call('HMGET', meta_key, 'prompt_length', 'conversation', 'shared')
local outputs, lead_in = false, ''
if meta[1] then
  local prompt_bytes = 4 * tonumber(meta[1])
  outputs = redis.call('GETRANGE', KEYS[3], prompt_bytes, -1) .. ARGV[3]
  if prompt_bytes > 0 then
    lead_in = redis.call('GETRANGE', KEYS[3], math.max(0, prompt_bytes - 8), prompt_bytes - 1)
  end
end
redis.call('UNLINK', unpack(KEYS))
return {outputs, meta[2], meta[3], lead_in}
