#include <stdio.h>
int main(void) {
  enum { N = 4096 };
  static float x[N], y[N];
  for (int i = 0; i < N; i++) { x[i] = i; y[i] = 1.0f; }
  #pragma omp target teams distribute parallel for map(to: x) map(tofrom: y)
  for (int i = 0; i < N; i++) y[i] = 2.0f * x[i] + y[i];
  int ok = 1;
  for (int i = 0; i < N; i++) ok &= y[i] == 2.0f * i + 1.0f;
  printf("%s\n", ok ? "PASS" : "FAIL");
  return !ok;
}
