# shellcheck shell=bash
# Sourced by scripts/setup.sh: apt-get that waits for another apt/dpkg (unattended-upgrades, a
# package manager window, a second `make setup`) to let go of its locks, and says so, instead of
# failing at once with "Could not get lock /var/lib/dpkg/lock-frontend".
#
#   LLMWD_DPKG_LOCK_TIMEOUT  seconds to wait (default 600); LLMWD_DPKG_LOCK_POLL  poll interval (2)
#   LLMWD_DPKG_LOCKS         the lock files (default: dpkg's and apt's); tests point it at a temp file

DPKG_LOCKS=${LLMWD_DPKG_LOCKS:-"/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock /var/cache/apt/archives/lock"}
DPKG_LOCK_TIMEOUT=${LLMWD_DPKG_LOCK_TIMEOUT:-600}

# lock_holder FILE: the pid holding a lock (POSIX, as apt takes it, or flock) on FILE; nothing if none.
# Read from /proc/locks, which needs no root: "1: POSIX  ADVISORY  WRITE 1234 08:01:5678 0 EOF",
# the device as hex major:minor; a waiter's line has "->" after the number and is skipped.
lock_holder() {
  local f=$1 dev ino id
  [ -e "$f" ] || return 0
  dev=$(stat -L -c %d "$f") && ino=$(stat -L -c %i "$f") || return 0
  id=$(printf '%02x:%02x:%s' $(( (dev >> 8) & 0xfff )) $(( (dev & 0xff) | ((dev >> 12) & 0xfff00) )) "$ino")
  awk -v id="$id" '$2 != "->" && $6 == id {print $5; exit}' /proc/locks 2>/dev/null || true
}

# wait_for_dpkg_lock: returns 0 once no lock in DPKG_LOCKS is held; 1 after DPKG_LOCK_TIMEOUT seconds.
wait_for_dpkg_lock() {
  local start=$SECONDS said="" f holder
  while :; do
    holder=""
    for f in $DPKG_LOCKS; do
      holder=$(lock_holder "$f")
      [ -z "$holder" ] || break
    done
    [ -n "$holder" ] || return 0
    if [ -z "$said" ]; then
      echo "setup: waiting for the dpkg lock: $f is held by pid $holder ($(ps -o comm= -p "$holder" 2>/dev/null || echo gone)); up to ${DPKG_LOCK_TIMEOUT}s" >&2
      said=1
    fi
    if [ $((SECONDS - start)) -ge "$DPKG_LOCK_TIMEOUT" ]; then
      echo "setup: the dpkg lock $f is still held by pid $holder after ${DPKG_LOCK_TIMEOUT}s; let that apt/dpkg finish (or stop it) and run make setup again" >&2
      return 1
    fi
    sleep "${LLMWD_DPKG_LOCK_POLL:-2}"
  done
}

# apt_get ARGS...: $SUDO apt-get ARGS, after the wait above; apt itself also waits (DPkg::Lock::Timeout,
# apt >= 1.9.11) should another one take the lock between our check and its start.
apt_get() {
  wait_for_dpkg_lock || return 1
  ${SUDO:-} apt-get -o DPkg::Lock::Timeout="$DPKG_LOCK_TIMEOUT" "$@"
}
