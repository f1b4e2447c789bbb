#!/usr/bin/env bash
# Install, then run a deletion campaign end to end on the embedded default: the real pre-trained
# MiniLM encoder with its last transformer layer fine-tuned on Reuters R8 (offline), a local SQLite
# ledger and version store, 8 requests in 4 batches removed by the newton-head variant
# (configs/methods/newton-head.yaml; its state prepared once and carried from batch to batch),
# each batch verified and published as a new version. Prints the campaign report.
#   bash scripts/campaign_demo.sh            # MiniLM + Reuters R8 (timing in the README)
#   bash scripts/campaign_demo.sh digits     # softmax regression on scikit-learn digits
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
