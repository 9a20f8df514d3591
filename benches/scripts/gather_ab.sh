#!/bin/bash
# A/B of two builds (OLD_BIN, NEW_BIN): ZeRO-1 and ZeRO-2 over two network-namespace
# "nodes" at 1 Gbit/s (tc tbf), 3 rounds alternated; median step and update (its all-gather
# included) over steps 5..25. Root only; the namespaces go on every exit.
set -u
: "${OLD_BIN:?the old build's oomguard}" "${NEW_BIN:?the new build's oomguard}"
A=(10.77.0.1 10.77.0.2); NS=(ogab0 ogab1); V=(ogabva ogabvb)
cleanup(){ for n in ${NS[@]}; do ip netns del $n 2>/dev/null; done; }
trap cleanup EXIT
cleanup
for n in ${NS[@]}; do ip netns add $n; done
ip link add ${V[0]} type veth peer name ${V[1]}
for i in 0 1; do ip link set ${V[$i]} netns ${NS[$i]}; ip -n ${NS[$i]} addr add ${A[$i]}/24 dev ${V[$i]}; ip -n ${NS[$i]} link set lo up; ip -n ${NS[$i]} link set ${V[$i]} up
 tc -n ${NS[$i]} qdisc add dev ${V[$i]} root tbf rate 1gbit burst 256kb latency 50ms; done
D=/tmp/nsab; rm -rf $D; mkdir -p $D; cd $D
cat > c.yaml <<'Y'
model: {n_layer: 12, n_head: 4, n_embd: 128, block_size: 128, vocab_size: 256}
data: {source: embedded}
train: {micro_batch_size: 8, grad_accum_steps: 1, global_batch_size: 16, max_steps: 25, eval_every: 0, eval_batch_size: 4, eval_batches: 1, device: cpu, num_threads: 1}
memory: {budget: none}
log: {every: 1000}
Y
export OOMGUARD_RUN_TOKEN=0123456789abcdef0123456789abcdef
for round in 0 1 2; do for b in old new; do for st in optimizer gradients; do
 bin=$OLD_BIN; [ $b = new ] && bin=$NEW_BIN
 run=$D/$b-$st-$round
 for i in 0 1; do ip netns exec ${NS[$i]} $bin launch --nnodes 2 --master-addr ${A[0]} --master-port 29517 --node-rank $i --nproc-per-node 1 --no-python $bin train c.yaml --run-dir $run --set train.shard=$st > $run.$i.log 2>&1 & done; wait
 python3 - "$run" "$b $st $round" <<'P'
import json,sys,statistics
s=[json.loads(l) for l in open(sys.argv[1]+'/metrics.jsonl') if '"step"' in l]
s=[x for x in s if x.get('event','step')=='step' and 'step_time_s' in x][5:]
print(sys.argv[2], 'median step %.1f ms, update %.1f ms'%(statistics.median(x['step_time_s'] for x in s)*1e3, statistics.median(x.get('update_s') or 0 for x in s)*1e3), len(s))
P
done; done; done
