# Adds this PC to a swarm as a fellow (Windows): served by the leader at @@LEADER_URL@@/install.ps1 with its join
# details filled in. Run it in PowerShell:  irm "@@LEADER_URL@@/install.ps1?token=..." | iex
# It checks Python (3.11+), makes a virtual environment under %LOCALAPPDATA%\swarm, installs PyTorch (CUDA where an
# NVIDIA GPU is present, the CPU build elsewhere), installs swarm from the leader (its sha256 checked), runs the early
# checks, and registers a scheduled task that runs `swarm join` at log-on.
# Leaving: closing the fellow's console, a log-off and a shutdown reach the fellow as console-control events, and it
# hands its stages over in the few seconds Windows gives (5 s; enough to switch to a hot cover, else they fail over).
# Stop-ScheduledTask ends the process at once: run `swarm leave` first to hand the stages over without a pause.
$ErrorActionPreference = "Stop"

$LeaderUrl = '@@LEADER_URL@@'
$JoinToken = '@@JOIN_TOKEN@@'
$WheelFile = '@@WHEEL_FILE@@'
$WheelSha256 = '@@WHEEL_SHA256@@'

function Fail([string]$Message) { Write-Host "error: $Message" -ForegroundColor Red; exit 1 }

# --- Python 3.11+ ---
$Python = $env:SWARM_PYTHON
if (-not $Python) {
    foreach ($Candidate in @("py -3.13", "py -3.12", "py -3.11", "python")) {
        $Parts = $Candidate.Split(" ")
        try {
            & $Parts[0] $Parts[1..9] -c "import sys; sys.exit(sys.version_info < (3, 11))" 2>$null
            if ($LASTEXITCODE -eq 0) { $Python = $Candidate; break }
        } catch { }
    }
}
if (-not $Python) {
    Fail "swarm needs Python 3.11 or newer and this PC has none. Install it (winget install Python.Python.3.12, or the installer from python.org), then run this command again."
}
$PyParts = $Python.Split(" ")

# --- a virtual environment under %LOCALAPPDATA%\swarm ---
$HomeDir = if ($env:SWARM_HOME) { $env:SWARM_HOME } else { Join-Path $env:LOCALAPPDATA "swarm" }
$Venv = Join-Path $HomeDir "venv"
$Py = Join-Path $Venv "Scripts\python.exe"
if (-not (Test-Path $Py)) {
    Write-Host "Creating a virtual environment in $Venv"
    New-Item -ItemType Directory -Force -Path $HomeDir | Out-Null
    & $PyParts[0] $PyParts[1..9] -m venv $Venv
    if ($LASTEXITCODE -ne 0) { Fail "could not create a virtual environment in $Venv." }
}

# --- PyTorch for this machine ---
& $Py -c "import torch" 2>$null
if ($LASTEXITCODE -ne 0) {
    $HasNvidia = $false
    try { & nvidia-smi -L 2>$null | Out-Null; $HasNvidia = ($LASTEXITCODE -eq 0) } catch { }
    if ($HasNvidia) {
        Write-Host "Installing PyTorch with CUDA (an NVIDIA GPU is present; about 2.5 GB)"
        & $Py -m pip install --disable-pip-version-check torch --index-url https://download.pytorch.org/whl/cu124
    } else {
        Write-Host "Installing the CPU build of PyTorch (no NVIDIA GPU found)"
        & $Py -m pip install --disable-pip-version-check torch
    }
    if ($LASTEXITCODE -ne 0) { Fail "could not install PyTorch; see pip's message above." }
}

# --- swarm, from the leader ---
$Tmp = Join-Path ([System.IO.Path]::GetTempPath()) ("swarm-" + [guid]::NewGuid())
New-Item -ItemType Directory -Path $Tmp | Out-Null
$Wheel = Join-Path $Tmp $WheelFile
Write-Host "Downloading swarm from $LeaderUrl"
try {
    Invoke-WebRequest -UseBasicParsing -Headers @{ Authorization = "Bearer $JoinToken" } -OutFile $Wheel "$LeaderUrl/api/v1/update/$WheelFile"
} catch { Fail "could not download swarm from ${LeaderUrl}: $($_.Exception.Message)" }
if ((Get-FileHash -Algorithm SHA256 $Wheel).Hash.ToLower() -ne $WheelSha256) {
    Fail "the swarm downloaded from $LeaderUrl does not match the sha256 the leader announced; nothing was installed."
}
& $Py -m pip install --disable-pip-version-check -q $Wheel
if ($LASTEXITCODE -ne 0) { Fail "could not install swarm; see pip's message above." }
Remove-Item -Recurse -Force $Tmp
$Swarm = Join-Path $Venv "Scripts\swarm.exe"
$Data = Join-Path $HomeDir "fellow"
$Name = if ($env:SWARM_NAME) { $env:SWARM_NAME } else { $env:COMPUTERNAME }

# --- early checks: joins the leader once and says what this PC can hold ---
& $Swarm join $LeaderUrl --token $JoinToken --name $Name --data-dir $Data --check
if ($LASTEXITCODE -ne 0) { Fail "this PC could not join $LeaderUrl; see the message above." }

# --- a scheduled task that runs swarm join at log-on ---
if ($env:SWARM_NO_SERVICE -eq "1") { Write-Host "Installed. Start the fellow with: $Swarm join $LeaderUrl --data-dir $Data"; exit 0 }
$Action = New-ScheduledTaskAction -Execute $Swarm -Argument "join $LeaderUrl --data-dir `"$Data`""
$Trigger = New-ScheduledTaskTrigger -AtLogOn -User $env:USERNAME
$Settings = New-ScheduledTaskSettingsSet -RestartCount 999 -RestartInterval (New-TimeSpan -Minutes 1) -ExecutionTimeLimit ([TimeSpan]::Zero)
Register-ScheduledTask -TaskName "swarm fellow" -Action $Action -Trigger $Trigger -Settings $Settings -Force | Out-Null
Start-ScheduledTask -TaskName "swarm fellow"
Write-Host "Installed: the fellow runs now and at every log-on (scheduled task 'swarm fellow')."
Write-Host "To take this PC out of the swarm without a pause in anyone's reply: $Swarm leave --data-dir `"$Data`""
