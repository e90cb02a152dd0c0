#!/usr/bin/env python3
"""Alternate expert-store configurations of `moetax bench --expert-budget` on one model, the way the
README's read-ahead figures were taken: before each run the page cache is dropped (root only; said
otherwise), the block device's read-sector counter is read around the run (whether the reads reached
the disk), one line per run, then medians per configuration and paired ratios per round against the
first configuration (and the last against the second).

usage: scripts/store_pairs.py MODEL TEXT ROUNDS [--device vda] [--threads 2] [--budget 25%] -- CONFIG...
  each CONFIG is one quoted string of store options, e.g. "--no-prefetch" "--read-ahead off" "--read-ahead 2"
"""
import argparse, json, os, statistics, subprocess, sys, time

ap = argparse.ArgumentParser(description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument('model'); ap.add_argument('text'); ap.add_argument('rounds', type=int)
ap.add_argument('--device', default='vda'); ap.add_argument('--threads', default='2')
ap.add_argument('--budget', default='25%'); ap.add_argument('--bin', default='./build/moetax')
ap.add_argument('configs', nargs='+')
a = ap.parse_args()
base = [a.bin, 'bench', '-m', a.model, '-p', '0', '-n', '64', '-t', a.threads, '-r', '2', '--no-mem',
        '--expert-budget', a.budget, '-f', a.text, '--json']

def sectors():
    try:
        return int(open('/sys/block/%s/stat' % a.device).read().split()[2])
    except OSError:
        return 0

def drop():
    try:
        os.sync()
        with open('/proc/sys/vm/drop_caches', 'w') as f:
            f.write('3')
        return True
    except OSError:
        return False

res = {}
for r in range(a.rounds):
    for ci, c in enumerate(a.configs):
        if not drop():
            print('(page cache not dropped: needs root)', file=sys.stderr)
        load = os.getloadavg()[0]
        s0, t0 = sectors(), time.time()
        p = subprocess.run(base + c.split(), capture_output=True, text=True)
        s1 = sectors()
        rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith('{')]
        st = next((x for x in rows if 'expert_budget_mib' in x), None)
        ide = next((x for x in rows if str(x.get('test', '')).startswith('store_')), None)
        if not st or not ide:
            sys.exit('bench failed (%s): %s' % (c, p.stderr.strip()[-500:]))
        d = dict(cfg=c, load=load, tps=st['tokens_per_s'], hit=st['hit_rate'], mib=st['read_mib_per_token'],
                 gbps=st['store_read_gbps'], ahead=st.get('ahead_reads_per_token') or 0,
                 aprec=st.get('ahead_precision') or 0, us=ide['us_per_token'], mapped=ide['mapped_us_per_token'],
                 ioref=ide['io_ref_gbps'], ideal=ide['ideal_us_per_token'], vs=ide['vs_ideal'],
                 disk_gib=(s1 - s0) * 512 / 2**30)
        res.setdefault(ci, []).append(d)
        print('%-22s r%d load %.1f | %6.2f t/s | hit %.3f | %5.2f MiB/tok at %.2f GB/s | ahead %5.2f/tok P %.2f | '
              '%6.0f us (mapped %6.0f, io_ref %.2f GB/s) ideal %6.0f -> %.2fx | device read %.2f GiB in %.0f s'
              % (c, r, load, d['tps'], d['hit'], d['mib'], d['gbps'], d['ahead'], d['aprec'], d['us'], d['mapped'],
                 d['ioref'], d['ideal'], d['vs'], d['disk_gib'], time.time() - t0), flush=True)
print('medians:')
for ci, rows in res.items():
    m = lambda k: statistics.median(x[k] for x in rows)
    print('%-22s %6.2f t/s | hit %.3f | %5.2f MiB/tok | %.2f GB/s | vs ideal %.2fx | mapped %.0f us'
          % (rows[0]['cfg'], m('tps'), m('hit'), m('mib'), m('gbps'), m('vs'), m('mapped')))
pairs = [(ci, 0) for ci in range(1, len(res))] + ([(len(res) - 1, 1)] if len(res) > 2 else [])
for x, y in pairs:
    q = [res[x][r]['tps'] / res[y][r]['tps'] for r in range(len(res[y]))]
    print('%s / %s per round: %s, median %.2f' % (res[x][0]['cfg'], res[y][0]['cfg'],
          ' '.join('%.2f' % v for v in q), statistics.median(q)))
