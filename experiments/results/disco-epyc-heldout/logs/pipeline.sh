# DISCO on the AVX2 EPYC, held-out prompts: the artifacts of ../disco-epyc (trained and tuned
# there) benched on prompts that collection never saw (int8 torch target, GGUF draft in a child).
cd "$(dirname "$0")/../../../.."  # the repository root
S=experiments/results/disco-epyc
D=experiments/results/disco-epyc-heldout
L=$D/logs
A=.venv/bin/adaspec
echo "start $(date)"
$A disco collect --suite humaneval:15,spec-bench:6 --exclude $S/data.pt --split 0,0,1 --max-new-tokens 64 --quant int8 --draft-quant gguf --out $D/data.pt --no-progress > $L/collect.log 2>&1 || exit 1
echo "collect done $(date)"
$A disco bench --data $D/data.pt --artifacts $S/humaneval.pt,$S/spec-bench.pt --limit 2,humaneval:5,summarization:1,rag:1 --out $D --max-new-tokens 48 --no-progress > $L/bench.log 2>&1
echo "bench done $(date) rc=$?"
# The bench above ran slower than planned on this machine (plain decoding 388 ms/token on the
# first prompt against 253 in the first run): stopped after its first prompt (HumanEval/10) and
# resumed on fewer prompts, every category kept:
# $A disco bench --data $D/data.pt --artifacts $S/humaneval.pt,$S/spec-bench.pt --limit 1,humaneval:3,translation:2,qa:2,math_reasoning:2 --out $D --max-new-tokens 48 --resume --no-progress > $L/bench-resumed.log 2>&1
