#!/usr/bin/env bash
# Install, then run a deletion campaign end to end on the embedded default: the real
# pre-trained MiniLM encoder fine-tuned on Reuters R8 (offline), a local SQLite ledger and
# version store, and a local Ray instance that runs the L-FOCI probe shards and the
# Hessian-vector products. Prints the campaign report.
#   bash scripts/campaign_demo.sh            # MiniLM + Reuters R8 (measured: 12 min training, once, then
#                                            #   2-3 min a batch, 4 batches, on 2 shared CPU cores)
#   bash scripts/campaign_demo.sh digits     # softmax regression on scikit-learn digits (about 1 min)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
py=.venv/bin/python
flavour="${1:-text}"
case "$flavour" in
  text) name=minilm-r8; model_config=configs/models/minilm-r8.yaml ;;
  digits) name=linear-digits; model_config=configs/models/linear-digits.yaml ;;
  *) echo "usage: $0 [text|digits]" >&2; exit 2 ;;
esac
demo="runs/demo/$name"
if [ ! -f "runs/models/$name/model.json" ]; then
  echo "== training runs/models/$name ($model_config)"
  "$py" -m jobs.cli train "$model_config" --output "runs/models/$name"
fi
rm -rf "$demo" && mkdir -p "$demo"
echo "== importing version 0 into $demo/store"
"$py" -m jobs.cli versions import --store "$demo/store" --model "$name" "runs/models/$name"
"$py" -m jobs.demo_campaign --model-dir "runs/models/$name" --store "$demo/store" --name "$name" \
  --out "$demo" --requests 8 --batch-size 2
echo "== running the campaign"
"$py" -m jobs.cli campaign run "$demo/campaign.yaml"
echo "== report"
cat "$demo"/store/"$name"/reports/demo/report.md
