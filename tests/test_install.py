#!/usr/bin/python3
# ctest-labels: install
"""test_install.py - `cmake --install` puts the CLI, the libraries, the headers and
moetax.pc in a prefix, and a program built only from pkg-config's flags links
against the installed library (shared and static) and runs.

usage: test_install.py MOETAX_BIN WORKDIR  (the build directory is MOETAX_BIN's)
"""
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)


PROGRAM = r'''
#include <moetax/gguf.h>
#include <moetax/model.h>
#include <stdio.h>
int main(int argc, char **argv) {
    struct moetax_model *m;
    if (argc < 2) return 2;
    moetax_status st = moetax_model_load(argv[1], &m);
    if (st) { printf("error: %s\n", moetax_last_error()); return 1; }
    printf("layers %d experts %d\n", m->hp.n_layer, m->hp.n_expert);
    moetax_model_free(m);
    return 0;
}
'''


def main():
    mt, work = sys.argv[1], sys.argv[2]
    build = os.path.dirname(os.path.abspath(mt))
    prefix = os.path.join(work, "install-prefix")
    shutil.rmtree(prefix, ignore_errors=True)
    r = subprocess.run(["cmake", "--install", build, "--prefix", prefix], capture_output=True, text=True)
    check(r.returncode == 0, f"cmake --install: {r.stderr}")
    for rel in ("bin/moetax", "include/moetax/model.h", "include/moetax/gguf.h"):
        check(os.path.exists(os.path.join(prefix, rel)), f"installed {rel}")
    libdirs = [d for d in ("lib", "lib64", "lib/x86_64-linux-gnu") if os.path.exists(os.path.join(prefix, d, "pkgconfig", "moetax.pc"))]
    check(len(libdirs) == 1, f"moetax.pc installed ({libdirs})")
    if not libdirs:
        return summary()
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(prefix, libdirs[0], "pkgconfig"))
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "moetax"], capture_output=True, text=True, env=env)
    check(flags.returncode == 0 and "-lmoetax" in flags.stdout and prefix in flags.stdout, f"pkg-config: {flags.stdout} {flags.stderr}")
    src = os.path.join(work, "install_prog.c")
    with open(src, "w") as f:
        f.write(PROGRAM)
    model = os.path.join(work, "install_tiny.gguf")
    subprocess.run([mt, "gen", "--preset", "tiny", "-o", model], check=True, capture_output=True)
    exe = os.path.join(work, "install_prog")
    libdir = os.path.join(prefix, libdirs[0])
    r = subprocess.run(["cc", src, "-o", exe] + flags.stdout.split() + [f"-Wl,-rpath,{libdir}"], capture_output=True, text=True)
    check(r.returncode == 0, f"build against the shared library: {r.stderr}")
    r = subprocess.run([exe, model], capture_output=True, text=True)
    check(r.returncode == 0 and "layers 3 experts 8" in r.stdout, f"shared: {r.stdout} {r.stderr}")
    sflags = subprocess.run(["pkg-config", "--static", "--cflags", "--libs", "moetax"], capture_output=True, text=True, env=env)
    r = subprocess.run(["cc", src, "-o", exe + "_static", os.path.join(libdir, "libmoetax.a")] +
                       [x for x in sflags.stdout.split() if x != "-lmoetax"], capture_output=True, text=True)
    check(r.returncode == 0, f"build against the static library: {r.stderr}")
    r = subprocess.run([exe + "_static", model], capture_output=True, text=True)
    check(r.returncode == 0 and "layers 3" in r.stdout, f"static: {r.stdout} {r.stderr}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
