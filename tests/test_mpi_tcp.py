#!/usr/bin/python3
# ctest-labels: mpi;netns
"""test_mpi_tcp.py - two "hosts" on this machine: two network namespaces joined by a bridge, one
rank in each, MPI over TCP only (`--mca btl tcp,self`, the namespaces' addresses only), mpirun
starting the ranks through an rsh agent that enters the namespace instead of ssh. The logits of
`eval` equal the single process's bit for bit (replicated attention, the exact combine), the
token-sharded dispatch gives the same greedy tokens, and `bench --batch` runs with its bytes
reported. Needs root and `ip netns` (SKIP otherwise, or where the kernel refuses namespaces);
the namespaces, the bridge and the agent are removed at the end, also after a failure.

usage: test_mpi_tcp.py MOETAX_BIN WORKDIR
"""
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "pycode-20m-q8_0.gguf")
TAG = f"mx{os.getpid() % 100000}"  # names unique to this run (IFNAMSIZ: at most 15 characters)
NS = [f"{TAG}a", f"{TAG}b"]
BR = f"{TAG}br"
def free_net():
    """A 10.X.0.0/24 that no route of this machine covers (a VPN or a cluster may use 10/8)."""
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    for k in range(170):
        x = 77 + (os.getpid() + k) % 170
        if f"10.{x}." not in routes:
            return f"10.{x}.0"
    return "10.77.0"


NET = free_net() if shutil.which("ip") else "10.77.0"
ADDR = [f"{NET}.2", f"{NET}.3"]
TOKENS = "1,5,9,13,17,21,25,29"


def sh(*args):
    return subprocess.run(list(args), capture_output=True, text=True)


def setup():
    cmds = [["ip", "link", "add", BR, "type", "bridge"], ["ip", "link", "set", BR, "up"],
            ["ip", "addr", "add", f"{NET}.1/24", "dev", BR]]
    for i, ns in enumerate(NS):
        h, c = f"{ns}h", f"{ns}c"
        cmds += [["ip", "netns", "add", ns], ["ip", "link", "add", h, "type", "veth", "peer", "name", c],
                 ["ip", "link", "set", c, "netns", ns], ["ip", "link", "set", h, "master", BR, "up"],
                 ["ip", "-n", ns, "addr", "add", f"{ADDR[i]}/24", "dev", c], ["ip", "-n", ns, "link", "set", c, "up"],
                 ["ip", "-n", ns, "link", "set", "lo", "up"]]
    for c in cmds:
        r = sh(*c)
        if r.returncode:
            return f"{' '.join(c)}: {r.stderr.strip()}"
    return None


def teardown():
    for ns in NS:  # a rank left behind by a timeout must not keep a namespace alive
        for pid in sh("ip", "netns", "pids", ns).stdout.split():
            try:
                os.kill(int(pid), 9)
            except (OSError, ValueError):
                pass
    for ns in NS:
        sh("ip", "netns", "del", ns)
        sh("ip", "link", "del", f"{ns}h")
    sh("ip", "link", "del", BR)


def main():
    moetax, work = os.path.abspath(sys.argv[1]), os.path.join(sys.argv[2], "mpi-tcp")
    os.makedirs(work, exist_ok=True)
    if not shutil.which("mpirun"):
        print("SKIP: mpirun is not installed (Debian: openmpi-bin)")
        return 0
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("SKIP: needs root and ip (iproute2) for network namespaces")
        return 0
    agent = os.path.join(work, "netns-agent.sh")
    with open(agent, "w") as f:  # mpirun calls it as `agent HOST COMMAND...` in place of ssh
        f.write("#!/bin/sh\nhost=\"$1\"; shift\ncase \"$host\" in\n")
        for a, ns in zip(ADDR, NS):
            f.write(f"  {a}) ns={ns} ;;\n")
        # each "host" gets a temporary directory of its own: two daemons of one job on one file
        # system would race for the same session directory (mkdir: File exists)
        f.write("  *) echo \"netns agent: unknown host $host\" >&2; exit 1 ;;\nesac\n"
                f"mkdir -p {work}/tmp-$ns\n"
                f"exec ip netns exec \"$ns\" env TMPDIR={work}/tmp-$ns /bin/sh -c \"$*\"\n")
    os.chmod(agent, 0o755)
    try:
        err = setup()
        if err:
            print(f"SKIP: no network namespaces here ({err})")
            return 0
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        base = ["mpirun", "--host", ",".join(ADDR), "-np", "2", "--mca", "plm_rsh_agent", agent, "--mca", "btl",
                "tcp,self", "--mca", "btl_tcp_if_include", f"{NET}.0/24", "--mca", "oob_tcp_if_include", f"{NET}.0/24",
                "-x", "MOETAX_MPI_TIMEOUT=60"]
        probe = subprocess.run(base + ["sh", "-c", "ip -brief addr"], capture_output=True, text=True, timeout=120, env=env)
        if not check(probe.returncode == 0 and ADDR[0] in probe.stdout and ADDR[1] in probe.stdout,
                     f"a rank in each namespace: {probe.stdout[-400:]} {probe.stderr[-600:]}"):
            return summary()
        ref = os.path.join(work, "ref.f32")
        r0 = subprocess.run([moetax, "eval", "-m", MODEL, "--tokens", TOKENS, "--decode", "4", "-t", "1", "--out", ref],
                            capture_output=True, text=True, timeout=120)
        check(r0.returncode == 0, f"single process eval: {r0.stderr[-300:]}")
        greedy0 = re.search(r"greedy: ([\d ]+)", r0.stdout + r0.stderr)
        for mode, extra in (("replicated", []), ("alltoall", ["-x", "MOETAX_MPI_DISPATCH=alltoall"])):
            got = os.path.join(work, f"got-{mode}.f32")
            r = subprocess.run(base + extra + [moetax, "eval", "-m", MODEL, "--tokens", TOKENS, "--decode", "4", "-t", "1",
                                               "--out", got], capture_output=True, text=True, timeout=180, env=env)
            if not check(r.returncode == 0, f"{mode}: np 2 over TCP: {r.stderr[-3000:]}"):
                continue
            check(len(re.findall(r"rank \d of 2: peak RSS", r.stderr)) == 2, f"{mode}: both ranks ran")
            g = re.search(r"greedy: ([\d ]+)", r.stdout + r.stderr)
            check(g and greedy0 and g.group(1).split() == greedy0.group(1).split(),
                  f"{mode}: greedy tokens {g and g.group(1)} == the single process's {greedy0 and greedy0.group(1)}")
            if mode == "replicated":
                check(open(got, "rb").read() == open(ref, "rb").read(), f"{mode}: logits bit-identical over TCP")
        rb = subprocess.run(base + ["-x", "MOETAX_MPI_DISPATCH=alltoall", moetax, "bench", "-m", MODEL, "-p", "8", "-n", "8",
                                    "-t", "1", "-r", "1", "--no-mem", "--batch", "4"],
                            capture_output=True, text=True, timeout=180, env=env)
        check(rb.returncode == 0 and re.search(r"rank 1 of 2: .* MB sent", rb.stderr),
              f"bench --batch 4 token-sharded over TCP, with its bytes: {rb.stderr[-800:]}")
    finally:
        teardown()
    left = sh("ip", "netns", "list").stdout
    check(not any(ns in left for ns in NS), f"namespaces removed: {left}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
