#!/bin/bash
# Before / after a change, through `adaspec serve` as users run it: experiments/serve_load.py
# (8 clients for 3 minutes, then 6 greedy requests one at a time, compared with the library),
# old and new alternating, two rounds, each server on a fresh $ADASPEC_HOME (an empty
# cross-request history) sharing the models and profiles.
#   git worktree add /tmp/old <commit>            # the code before
#   cp -a ~/.cache/adaspec/runtimes/ik_llama.cpp-<v> /tmp/ik-runtime-backup   # its native build
#   experiments/serve_ab.sh                        # results under /tmp/ab
#   AB=/tmp/ab2 ROUNDS="1 2 3" experiments/serve_ab.sh   # elsewhere, more rounds
set -u
cd /work/main
AB=${AB:-/tmp/ab}
for round in ${ROUNDS:-1 2}; do
  for which in old new; do
    home=$AB/home-$which-$round; mkdir -p $home/runtimes
    for d in gguf models probes profiles; do ln -sfn /root/.cache/adaspec/$d $home/$d; done
    if [ $which = old ]; then
      ln -sfn /tmp/ik-runtime-backup $home/runtimes/ik_llama.cpp-0.1.5; pp=/tmp/old/src
    else
      ln -sfn /root/.cache/adaspec/runtimes/ik_llama.cpp-0.1.5 $home/runtimes/ik_llama.cpp-0.1.5; pp=/work/main/src
    fi
    echo "== $which round $round $(date +%T)"
    ADASPEC_HOME=$home PYTHONPATH=$pp .venv/bin/python experiments/serve_load.py --clients 8 --minutes 3 --overhead-requests 6 --out $AB/$which-$round > $AB/$which-$round.log 2>&1
    tail -3 $AB/$which-$round.log
  done
done
echo "== done $(date +%T)"
