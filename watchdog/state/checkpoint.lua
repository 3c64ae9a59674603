-- Save one partition's checkpoint, fenced and idempotent. Loaded by watchdog/state/checkpoint.py.
--
-- KEYS[1] owner key (the partition's ownership token)   KEYS[2] checkpoint hash
-- KEYS[3] windows stream   KEYS[4] outbox stream   KEYS[5..] engine-state keys (one per route)
-- ARGV[1] our token  ARGV[2] sequence number  ARGV[3] checkpoint meta JSON  ARGV[4] windows MAXLEN
-- ARGV[5] W window records  ARGV[6] B outbox records  ARGV[7] F changed open-window fields
-- ARGV[8] D closed-window fields  ARGV[9] '1' = incremental (needs the stored hash to build on);
--   else a full snapshot, which replaces the hash
-- then: W window records, B outbox records, F (field, value) pairs, D fields, one engine JSON per KEYS[5..]
-- ('' deletes that engine-state key: the route was forgotten as idle)
--
-- The hash holds 'seq', 'json' (meta) and one field per open window. Returns {status, detail}:
-- saved | duplicate (this sequence number, or a later one, is stored already: a retried save whose
-- first attempt landed) | fenced (another owner holds the partition) | resync (an incremental save
-- but Redis lost the hash: send everything).

local owner = redis.call('GET', KEYS[1])
if not owner then
  -- Redis lost the key (restart without persistence, failover): nobody claimed the partition since
  -- (a claim sets it), so the writer keeps it
  redis.call('SET', KEYS[1], ARGV[1])
elseif owner ~= ARGV[1] then
  return {'fenced', owner}
end
local cur = tonumber(redis.call('HGET', KEYS[2], 'seq') or '0')
local seq = tonumber(ARGV[2])
if cur >= seq then
  return {'duplicate', tostring(cur)}
end
if ARGV[9] == '1' and cur == 0 then
  return {'resync', '0'}
end
local nw, nb, nf, nd = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
if ARGV[9] ~= '1' then
  -- a full snapshot carries every open window: it replaces the hash, so no field of a checkpoint
  -- it did not build on (one of a schema that was ignored, say) survives into the next restore
  redis.call('DEL', KEYS[2])
end
redis.call('HSET', KEYS[2], 'seq', ARGV[2], 'json', ARGV[3])
local i = 10
for _ = 1, nw do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'json', ARGV[i])
  i = i + 1
end
for _ = 1, nb do
  redis.call('XADD', KEYS[4], '*', 'json', ARGV[i])
  i = i + 1
end
for _ = 1, nf do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  i = i + 2
end
for _ = 1, nd do
  redis.call('HDEL', KEYS[2], ARGV[i])
  i = i + 1
end
for k = 5, #KEYS do
  if ARGV[i] == '' then
    redis.call('DEL', KEYS[k])
  else
    redis.call('SET', KEYS[k], ARGV[i])
  end
  i = i + 1
end
return {'saved', ARGV[2]}
