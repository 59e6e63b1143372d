"""Who holds a GPU or a port a stage needs, and how to free it.

The usual holder on a GPU host is a server the user started: the generation server of
`generate.backend: openai` (SGLang or vLLM on all the GPUs, often on port 30000, which is also
`deploy.port`'s default), still up when extract or deploy wants the GPUs. A message that says
"pid 5120" sends the user to `ps`; one that shows the command line and says which process to
stop does not. The command line of another user's process may not be readable: then only what
nvidia-smi reported is shown.
"""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass

import psutil

from draftsmith.errors import TransientError

# Command-line fragments of the model servers users start by hand.
MODEL_SERVERS = ("sglang.launch_server", "sglang serve", "vllm serve", "vllm.entrypoints",
                 "transformers serve", "text-generation-launcher", "trtllm-serve",
                 "llama-server", "draftsmith deploy")
SHOWN_CHARS = 300  # of a command line: model paths and flags, not a page of them


class PortBusyError(TransientError, RuntimeError):
    """A port a stage's server must bind is taken by another process (retried: the holder
    may be on its way out)."""


@dataclass(frozen=True)
class Holder:
    pid: int
    command: str | None  # the command line, None when it cannot be read (another user's)

    @property
    def is_model_server(self) -> bool:
        return self.command is not None and any(m in self.command for m in MODEL_SERVERS)

    def describe(self) -> str:
        if self.command is None:
            return f"pid {self.pid} (its command line cannot be read by this user)"
        command = self.command
        if len(command) > SHOWN_CHARS:
            command = command[:SHOWN_CHARS] + " ..."
        return f"pid {self.pid}: {command}"


def command_line(pid: int) -> str | None:
    """The process's command line as a shell would read it, or None (gone, another user's)."""
    try:
        argv = psutil.Process(pid).cmdline()
    except (psutil.Error, OSError):
        return None
    return shlex.join(argv) if argv else None


def server_root(pid: int) -> Holder:
    """The process to stop for `pid` to let go: its outermost ancestor that is a model server
    (SGLang's and vLLM's GPU workers are children of the server that was started), else
    `pid` itself."""
    found = Holder(pid, command_line(pid))
    try:
        parents = psutil.Process(pid).parents()
    except (psutil.Error, OSError):
        return found
    for parent in parents:  # nearest first
        holder = Holder(parent.pid, command_line(parent.pid))
        if holder.is_model_server:
            found = holder
    return found


def how_to_free(holders: list[Holder], others_hint: str = "a leftover server") -> str:
    """The advice after a list of holders: which processes to stop, and how."""
    unique = list(dict.fromkeys(holders))
    servers = [h for h in unique if h.is_model_server]
    others = [h for h in unique if not h.is_model_server]
    advice = []
    if servers:
        pids = " ".join(str(h.pid) for h in servers)
        one = len(servers) == 1
        what = f"pid {pids} is a model server" if one else f"pids {pids} are model servers"
        advice.append(
            f"{what} started outside this run: if {'it' if one else 'one'} is the generation "
            "server you started for generate (generate.backend: openai), generate is done with "
            f"it. Stop {'it' if one else 'them'} with `kill {pids}` (or Ctrl-C where it runs; "
            "its GPU workers stop with it)")
    if others:
        pids = " ".join(str(h.pid) for h in others)
        which = "the others" if servers else "it" if len(others) == 1 else "them"
        advice.append(f"stop {which} with `kill {pids}` ({others_hint})")
    return "; ".join(advice)


def listening(host: str, port: int) -> list[Holder]:
    """The processes listening on `port` at `host` (or on every address), when this user can
    see them."""
    try:
        wanted = ipaddress.ip_address(host)
    except ValueError:
        wanted = None  # a host name: any address on the port
    found = {}
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    for conn in connections:
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr.port != port:
            continue
        address = ipaddress.ip_address(conn.laddr.ip.split("%")[0])
        if wanted is not None and not (address == wanted or address.is_unspecified
                                       or wanted.is_unspecified):
            continue
        if conn.pid is not None:
            found[conn.pid] = server_root(conn.pid)
    return list(dict.fromkeys(found.values()))


def port_busy_message(section: str, host: str, port: int) -> str:
    """Why `host:port` cannot be had: who listens there and how to free it, or, when the
    holder cannot be seen, how to find it."""
    holders = listening(host, port)
    if not holders:
        return (f"{section}: {host}:{port} is already in use by a process this user cannot see "
                f"(`sudo ss -ltnp 'sport = :{port}'` names it): stop it, or set {section}.port "
                "to a free port")
    listing = "; ".join(h.describe() for h in holders)
    return (f"{section}: {host}:{port} is already in use by a server this run did not start "
            f"({listing}): {how_to_free(holders)}; or set {section}.port to a free port")


def require_free_port(section: str, host: str, port: int) -> None:
    """Raise naming who listens on `host:port`, when something does."""
    from draftsmith.serve.readiness import port_open

    if port_open(host, port):
        raise PortBusyError(port_busy_message(section, host, port))
