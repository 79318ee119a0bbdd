#!/usr/bin/env bash
# Stop Ray on every worker of an on-premises cluster (provider: local), from the head.
#
# `ray down` runs `ray stop` on the head only: the local provider has no machines to terminate, so the
# workers' raylets would go on. onprem.yaml's head_setup_commands make `ray stop` in the head's login shell
# (how `ray down` runs it) call this first. It reads the worker addresses, the SSH user and the key from the
# config the launcher copied to the head, and stops Ray on every worker at once through SSH; a worker it cannot
# reach is named on stderr. Nothing happens for any other provider. The remote shell sources ~/.bashrc itself,
# as the launcher's own commands do: the venv (and so `ray`) is activated there, and a login shell reads
# ~/.bashrc only through a ~/.profile that says so.
set -uo pipefail

config=${1:-$HOME/ray_bootstrap_config.yaml}
[ -f "$config" ] || exit 0
python - "$config" <<'PY' | { while read -r user key ip; do
import sys

import yaml

with open(sys.argv[1]) as f:
    cfg = yaml.safe_load(f) or {}
provider, auth = cfg.get("provider") or {}, cfg.get("auth") or {}
if provider.get("type") == "local":
    for ip in provider.get("worker_ips") or []:
        print(auth.get("ssh_user", "ubuntu"), auth.get("ssh_private_key", "~/ray_bootstrap_key.pem"), ip)
PY
    { ssh -n -i "${key/#\~/$HOME}" -o BatchMode=yes -o ConnectTimeout=10 -o StrictHostKeyChecking=accept-new \
        "$user@$ip" 'bash --login -c -i "source ~/.bashrc; ray stop"' >/dev/null 2>&1 \
        && echo "stopped Ray on worker $ip" \
        || echo "rayfl: could not stop Ray on worker $ip (ssh $user@$ip 'ray stop' there)" >&2; } &
done; wait; }
