// What the benchmarks print and plot, without running them (bench/support/report.hpp).
#include <catch2/catch.hpp>

#include "support/report.hpp"

using td_bench::log_ticks;
using td_bench::speed_phrase;

TEST_CASE("a speed factor below 1 is worded as slower", "[bench]") {
  CHECK(speed_phrase(1.0, 3.74, "per-leaf") == "3.74x faster than per-leaf");
  // auto took 1.02x the per-leaf time: issue 20 saw this printed as "0.98x faster".
  CHECK(speed_phrase(3.351, 3.285, "per-leaf") == "1.02x slower than per-leaf");
  CHECK(speed_phrase(2.0, 1.0, "per-leaf") == "2.00x slower than per-leaf");
  CHECK(speed_phrase(1.0, 1.004, "per-leaf") == "as fast as per-leaf (1.00x)");
  CHECK(speed_phrase(1.004, 1.0, "per-leaf") == "as fast as per-leaf (1.00x)");
  CHECK(speed_phrase(0.0, 1.0, "per-leaf") == "not comparable with per-leaf");
}

TEST_CASE("log-axis ticks: at least four labelled values in a panel's range", "[bench]") {
  // A panel from 0.7x to 3x used to show the single tick "1".
  const auto narrow = log_ticks(0.7, 3.0);
  CHECK(narrow.size() >= 4);
  CHECK(std::find(narrow.begin(), narrow.end(), 1.0) != narrow.end());
  for (double v : narrow) CHECK((v >= 0.7 && v <= 3.0));
  // Wide ranges use whole decades.
  CHECK(log_ticks(0.5, 2000.0) == std::vector<double>{1, 10, 100, 1000});
  // 1-2-5 in between.
  CHECK(log_ticks(0.6, 12.0) == std::vector<double>{1, 2, 5, 10});
  CHECK(log_ticks(2.0, 1.0).empty());
}
