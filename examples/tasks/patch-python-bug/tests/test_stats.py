import sys
sys.path.insert(0, "/app")
from stats import median, mean

xs = [4, 1, 3, 2]
assert median(xs) == 2.5, median(xs)
assert xs == [4, 1, 3, 2], "median modified its argument"
assert median([5]) == 5
assert median([3, 1, 2]) == 2
assert median([1.0, 2.0]) == 1.5
assert mean([1, 2, 3]) == 2
print("ok")
