"""A script written for `python -m torch.distributed.launch`: it parses --local_rank itself and
rejects any argument it does not know (so `--local-rank=0` would fail)."""
import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()
with open(os.path.join(args.out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"local_rank_arg": args.local_rank, "LOCAL_RANK": os.environ["LOCAL_RANK"]}, f)
