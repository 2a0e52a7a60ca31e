# One GPU: SIGTERM a ResNet-18 run (fused AdamW, channels_last) after its first checkpoint, resume it,
# then time the checkpoint pause of ResNet-50. OUT=dir bash benchmarks/gpu_resume_check.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
A="--model resnet18 --data synthetic:4000 --image-size 64 --batch-size 64 --epochs 2 --devices 1 --checkpoint-every 8 --workers 2 --optimizer adamw --out /tmp/s"
python3 -m multigpu train $A > $OUT/stop.log 2>&1 & P=$!
for i in $(seq 1 240); do [ -f /tmp/s/checkpoints/manifest.json ] && break; sleep 0.5; done; sleep 1; kill -TERM $P; wait $P; echo "stop rc=$?" >> $OUT/stop.log
timeout 150 python3 -m multigpu train $A --resume /tmp/s > $OUT/resume.log 2>&1; echo "resume rc=$?" >> $OUT/resume.log
cat /tmp/s/metrics.jsonl >> $OUT/resume.log
timeout 100 python3 benchmarks/checkpoint_pause.py --model resnet50 --optimizer adamw --trials 2 --out $OUT > $OUT/pause.log 2>&1
tail -n 3 $OUT/stop.log $OUT/resume.log $OUT/pause.log
