#!/bin/sh
# Adds this PC to a swarm as a fellow: served by the leader at @@LEADER_URL@@/install.sh with its join details filled
# in. Linux and macOS. It checks Python (3.11+), makes a virtual environment under your data folder, installs PyTorch
# (with CUDA where an NVIDIA GPU is present, the small CPU build elsewhere), installs swarm from the leader (its
# sha256 checked), runs the early checks (what this PC can hold), and registers a service that runs `swarm join` at
# start-up: a systemd user unit on Linux, a launchd agent on macOS.
#
# Stopping the service (systemctl --user stop, launchctl unload, a log-out, a shutdown) sends the fellow SIGTERM and
# gives it SWARM_LEAVE_WAIT_S and 30 s more before SIGKILL: it hands its stages over first, so replies go on without a
# pause. Only a crash restarts it: a fellow that left (swarm leave, Drain on the admin page) stays gone until the next
# start-up or a start by hand.
#
# Settings (environment): SWARM_PYTHON (the Python to use), SWARM_HOME (where the environment goes),
# SWARM_NAME (this fellow's name; default the host name), SWARM_NO_SERVICE=1 (do not register a service),
# SWARM_LEAVE_WAIT_S (how long a leaving fellow waits for its stages to be handed over; default 60).
set -eu

LEADER_URL='@@LEADER_URL@@'
JOIN_TOKEN='@@JOIN_TOKEN@@'
WHEEL_FILE='@@WHEEL_FILE@@'
WHEEL_SHA256='@@WHEEL_SHA256@@'

say() { printf '%s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# --- Python 3.11+ ---------------------------------------------------------------------------------------------------
PYTHON="${SWARM_PYTHON:-}"
if [ -z "$PYTHON" ]; then
  for candidate in python3.13 python3.12 python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
      PYTHON=$(command -v "$candidate")
      break
    fi
  done
fi
if [ -z "$PYTHON" ]; then
  die "swarm needs Python 3.11 or newer and this PC has none. Install it (Debian/Ubuntu: sudo apt install python3 \
python3-venv; Fedora: sudo dnf install python3; macOS: brew install python@3.12, or the installer from python.org), \
then run this command again."
fi
say "Using $PYTHON ($("$PYTHON" -c 'import platform; print(platform.python_version())'))"

# --- a virtual environment under the data folder -------------------------------------------------------------------
case "$(uname -s)" in
  Darwin) HOME_DIR="${SWARM_HOME:-$HOME/Library/Application Support/swarm}" ;;
  *) HOME_DIR="${SWARM_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/swarm}" ;;
esac
VENV="$HOME_DIR/venv"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  say "Creating a virtual environment in $VENV"
  mkdir -p "$HOME_DIR"
  "$PYTHON" -m venv "$VENV" ||
    die "could not create a virtual environment in $VENV. On Debian/Ubuntu install python3-venv \
(sudo apt install python3-venv), then run this command again."
fi
"$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip --upgrade >/dev/null 2>&1 ||
  die "the virtual environment in $VENV has no pip; delete that folder and run this command again."

# --- PyTorch for this machine ----------------------------------------------------------------------------------------
if "$PY" -c 'import torch' >/dev/null 2>&1; then
  say "PyTorch is already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "Installing PyTorch with CUDA (an NVIDIA GPU is present; about 2.5 GB)"
  "$PY" -m pip install --disable-pip-version-check torch || die "could not install PyTorch; see pip's message above."
elif [ "$(uname -s)" = Darwin ]; then
  say "Installing PyTorch (uses the Apple GPU through MPS)"
  "$PY" -m pip install --disable-pip-version-check torch || die "could not install PyTorch; see pip's message above."
else
  say "Installing the CPU build of PyTorch (no NVIDIA GPU found; about 200 MB)"
  "$PY" -m pip install --disable-pip-version-check torch --index-url https://download.pytorch.org/whl/cpu ||
    die "could not install PyTorch; see pip's message above."
fi

# --- swarm, from the leader ------------------------------------------------------------------------------------------
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
say "Downloading swarm from $LEADER_URL"
curl -fsSL -H "Authorization: Bearer $JOIN_TOKEN" -o "$TMP/$WHEEL_FILE" "$LEADER_URL/api/v1/update/$WHEEL_FILE" ||
  die "could not download swarm from $LEADER_URL; check that this PC reaches it and that the join token is valid."
if command -v sha256sum >/dev/null 2>&1; then
  SUM=$(sha256sum "$TMP/$WHEEL_FILE" | cut -d ' ' -f 1)
else
  SUM=$(shasum -a 256 "$TMP/$WHEEL_FILE" | cut -d ' ' -f 1)
fi
[ "$SUM" = "$WHEEL_SHA256" ] ||
  die "the swarm downloaded from $LEADER_URL does not match the sha256 the leader announced; nothing was installed."
"$PY" -m pip install --disable-pip-version-check -q "$TMP/$WHEEL_FILE" ||
  die "could not install swarm; see pip's message above."
SWARM="$VENV/bin/swarm"
DATA="$HOME_DIR/fellow"
NAME="${SWARM_NAME:-$(hostname 2>/dev/null || uname -n)}"

# --- early checks: joins the leader once and says what this PC can hold --------------------------------------------
"$SWARM" join "$LEADER_URL" --token "$JOIN_TOKEN" --name "$NAME" --data-dir "$DATA" --check ||
  die "this PC could not join $LEADER_URL; see the message above."

# --- a service that runs swarm join at start-up ----------------------------------------------------------------------
RUN="$SWARM join $LEADER_URL --data-dir $DATA"
LEAVE_WAIT_S="${SWARM_LEAVE_WAIT_S:-60}"
case "$LEAVE_WAIT_S" in
  ''|*[!0-9]*) die "SWARM_LEAVE_WAIT_S must be a whole number of seconds, not '$LEAVE_WAIT_S'." ;;
esac
# The handover's wait, the fellow's 5 s for the leader's answer, and unloading: then SIGKILL.
STOP_S=$((LEAVE_WAIT_S + 30))
if [ "$STOP_S" -gt 120 ]; then
  say "note: at a shutdown systemd stops your user's services within 120 s (user@.service's TimeoutStopSec): with \
SWARM_LEAVE_WAIT_S=$LEAVE_WAIT_S a handover still running then fails over. Under 90 s fits."
fi
if [ "${SWARM_NO_SERVICE:-}" = 1 ]; then
  say "Installed. Start the fellow with: $RUN"
  exit 0
fi
case "$(uname -s)" in
  Darwin)
    AGENT="$HOME/Library/LaunchAgents/org.swarm.fellow.plist"
    mkdir -p "$(dirname "$AGENT")"
    cat > "$AGENT" <<PLIST
<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<plist version="1.0"><dict>
  <key>Label</key><string>org.swarm.fellow</string>
  <key>ProgramArguments</key><array>
    <string>$SWARM</string><string>join</string><string>$LEADER_URL</string>
    <string>--data-dir</string><string>$DATA</string>
  </array>
  <key>EnvironmentVariables</key><dict>
    <key>SWARM_LEAVE_WAIT_S</key><string>$LEAVE_WAIT_S</string>
  </dict>
  <key>RunAtLoad</key><true/>
  <key>KeepAlive</key><dict><key>SuccessfulExit</key><false/></dict>
  <key>ExitTimeOut</key><integer>$STOP_S</integer>
  <key>StandardErrorPath</key><string>$HOME_DIR/fellow.log</string>
</dict></plist>
PLIST
    launchctl unload "$AGENT" >/dev/null 2>&1 || true
    if launchctl load -w "$AGENT"; then
      say "Installed: the fellow runs now and at every log-in (launchd agent org.swarm.fellow; log: $HOME_DIR/fellow.log)."
    else
      say "Installed, but launchd did not start the agent; start the fellow with: $RUN"
    fi
    ;;
  *)
    UNIT_DIR="${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user"
    mkdir -p "$UNIT_DIR"
    cat > "$UNIT_DIR/swarm-fellow.service" <<UNIT
[Unit]
Description=swarm fellow (joins $LEADER_URL)
After=network-online.target

[Service]
ExecStart="$SWARM" join $LEADER_URL --data-dir "$DATA"
Environment=SWARM_LEAVE_WAIT_S=$LEAVE_WAIT_S
# Stop (and a log-out or shutdown, which stop the user's units): SIGTERM to the fellow alone, which hands its
# stages over, then SIGKILL to what is left after TimeoutStopSec.
KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec=$STOP_S
Restart=on-failure
RestartSec=5

[Install]
WantedBy=default.target
UNIT
    if systemctl --user daemon-reload >/dev/null 2>&1 && systemctl --user enable --now swarm-fellow.service >/dev/null 2>&1; then
      say "Installed: the fellow runs now and at every start-up (systemctl --user status swarm-fellow)."
      say "To keep it running while you are logged out: sudo loginctl enable-linger $(id -un)"
    else
      say "Installed, and wrote $UNIT_DIR/swarm-fellow.service, but there is no systemd user session here to start it."
      say "Start the fellow with: $RUN"
    fi
    ;;
esac
