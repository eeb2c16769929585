#!/bin/bash
# Lab (kept in history only; H100, 2026-12-06): ncu source-level stall sampling of one layer's gluon kernels at N tokens
NCU=/usr/local/cuda/bin/ncu
for N in 512 4096; do
  $NCU --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source no \
    -k regex:fragment_kernel --launch-skip 2 --launch-count 2 -f -o $OUT/layer$N python3 bench/lab_ncu_layer.py $N > $OUT/ncu$N.log 2>&1
  $NCU -i $OUT/layer$N.ncu-rep --page source --csv --print-source sass > $OUT/sass$N.csv 2>$OUT/sass$N.err
  $NCU -i $OUT/layer$N.ncu-rep --page details --csv > $OUT/details$N.csv 2>&1
  ls -la $OUT; tail -3 $OUT/ncu$N.log; head -c 600 $OUT/sass$N.csv; cat $OUT/sass$N.err | head
done
