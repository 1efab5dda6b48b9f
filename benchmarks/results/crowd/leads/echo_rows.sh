# usage: echo_rows.sh TREE TAG
T=$1; G=$2; O=/work/notes/unique/$G; mkdir -p $O
cd $T
export PYTHONPATH=$T
/work/main/.venv/bin/python benchmarks/bench_crowd_poison.py --crowds 0,3,10,100 --attacks echo_source,echo_soft,echo_newcomer,echo_soft_newcomer --defences sponsors --seeds 1 --no-volunteer --max-trainers 3 --jobs 1 --out $O/test > $O/test.log 2>&1
/work/main/.venv/bin/python benchmarks/bench_crowd_poison.py --preset tiny --crowds 0,10,100 --attacks echo_source,echo_soft --defences sponsors --seeds 1 --no-volunteer --jobs 1 --out $O/tiny > $O/tiny.log 2>&1
/work/main/.venv/bin/python benchmarks/bench_graduation.py --rows members@0.25,volunteer --preset tiny --seeds 2 --jobs 1 --out $O/grad-tiny > $O/grad-tiny.log 2>&1
/work/main/.venv/bin/python benchmarks/bench_graduation.py --rows members@0.25 --preset test --seeds 2 --jobs 1 --out $O/grad-test > $O/grad-test.log 2>&1
cp /work/notes/echo/grad_rows.py $T/ && /work/main/.venv/bin/python grad_rows.py 0 1 > $O/dips.txt 2>&1
echo DONE >> $O/test.log
