-- One atomic flag change: check fencing epoch and pin, write the route hash, index it, append an
-- audit record, publish a notification. Loaded by watchdog/actuation/actuator.py (FlagStore).
--
-- KEYS[1] route hash   KEYS[2] routes index (set)   KEYS[3] audit stream
-- ARGV[1] op: set | pin | unpin
-- ARGV[2] mode: policy | manual        (policy writes are refused while pinned)
-- ARGV[3] precision                    (ignored by unpin)
-- ARGV[4] expected epoch, '' = accept whatever is current
-- ARGV[5] reason  ARGV[6] policy  ARGV[7] changed_by
-- ARGV[8] now (unix seconds), '' = server TIME
-- ARGV[9] pin ttl seconds (pin only)
-- ARGV[10] audit MAXLEN (approximate)  ARGV[11] pub/sub channel
-- ARGV[12] model  ARGV[13] route  ARGV[14] schema version
-- Optional, for the daemon's policy writes (decision, state and page in one step):
-- KEYS[4] owner key of the partition carrying the route   ARGV[15] the writer's ownership token
-- KEYS[5] engine-state key of the route   ARGV[16] its JSON ('' = leave it)
-- KEYS[6] outbox stream                   ARGV[17] the page record JSON ('' = none)
-- The engine state and the page are written when the flip is applied or the route already served
-- the target; nothing is written when the token is stale (status fenced). An absent owner key (Redis
-- lost it) lets the write through: a claim by another replica would have set it.
--
-- Returns {status, epoch, precision, pinned_until}; status is one of
-- applied | unchanged | stale | pinned | missing | fenced.

local op, mode, precision, expected = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

if #KEYS >= 4 and ARGV[15] ~= nil and ARGV[15] ~= '' then
  local owner = redis.call('GET', KEYS[4])
  if owner and owner ~= ARGV[15] then
    return {'fenced', '0', '', ''}
  end
end

-- The page is written once per decision: its digest is kept in the route hash (field ``page``), so
-- a retry of a flip that was applied but whose reply was lost (a socket timeout) finds the same
-- digest and writes no second page. A decision's record is the same bytes at every attempt.
local function side_effects()
  if #KEYS >= 6 then
    if ARGV[16] ~= '' then redis.call('SET', KEYS[5], ARGV[16]) end
    if ARGV[17] ~= '' then
      local digest = redis.sha1hex(ARGV[17])
      if redis.call('HGET', KEYS[1], 'page') ~= digest then
        redis.call('XADD', KEYS[6], '*', 'json', ARGV[17])
        redis.call('HSET', KEYS[1], 'page', digest)
      end
    end
  end
end

local now
if ARGV[8] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[8])
end

local cur = redis.call('HMGET', KEYS[1], 'precision', 'epoch', 'pinned_until')
local cur_precision = cur[1] or ''
local epoch = tonumber(cur[2] or '0') or 0
local pin_raw = cur[3] or ''
local pinned_until = tonumber(pin_raw) or 0

-- Already serving the target: nothing to write, whatever epoch the caller saw.
if op == 'set' and cur_precision == precision then
  side_effects()
  return {'unchanged', tostring(epoch), cur_precision, pin_raw}
end
if expected ~= '' and tonumber(expected) ~= epoch then
  return {'stale', tostring(epoch), cur_precision, pin_raw}
end
if mode ~= 'manual' and pinned_until > now then
  return {'pinned', tostring(epoch), cur_precision, pin_raw}
end
if op == 'unpin' then
  if cur_precision == '' then
    return {'missing', tostring(epoch), '', ''}
  end
  if pin_raw == '' then
    return {'unchanged', tostring(epoch), cur_precision, ''}
  end
  precision = cur_precision
end

local new_epoch = epoch + 1
local now_s = string.format('%.6f', now)
redis.call('HSET', KEYS[1], 'model', ARGV[12], 'route', ARGV[13], 'precision', precision,
  'epoch', tostring(new_epoch), 'reason', ARGV[5], 'policy', ARGV[6], 'changed_at', now_s,
  'changed_by', ARGV[7], 'mode', mode)

local new_pin = ''
if op == 'pin' then
  new_pin = string.format('%.6f', now + tonumber(ARGV[9]))
  redis.call('HSET', KEYS[1], 'pinned_until', new_pin)
elseif op == 'unpin' or (pin_raw ~= '' and pinned_until <= now) then
  redis.call('HDEL', KEYS[1], 'pinned_until')
else
  new_pin = pin_raw
end

redis.call('SADD', KEYS[2], KEYS[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[10], '*',
  'schema', ARGV[14], 'ts', now_s, 'op', op, 'mode', mode,
  'model', ARGV[12], 'route', ARGV[13], 'precision', precision, 'previous', cur_precision,
  'epoch', tostring(new_epoch), 'reason', ARGV[5], 'policy', ARGV[6], 'changed_by', ARGV[7],
  'pinned_until', new_pin)

local msg = {schema = tonumber(ARGV[14]), model = ARGV[12], route = ARGV[13], precision = precision,
  epoch = new_epoch, changed_at = now, pinned_until = cjson.null}
if new_pin ~= '' then msg.pinned_until = tonumber(new_pin) end
redis.call('PUBLISH', ARGV[11], cjson.encode(msg))
side_effects()

return {'applied', tostring(new_epoch), precision, new_pin}
