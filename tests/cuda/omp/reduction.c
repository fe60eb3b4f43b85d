/* A target reduction: the sum of i*i over 0..N on the offload device. */
#include <stdio.h>
int main(void) {
    const long n = 100000;
    long sum = 0;
#pragma omp target teams distribute parallel for reduction(+ : sum) map(tofrom : sum)
    for (long i = 0; i < n; i++) sum += i * i;
    long want = (n - 1) * n * (2 * n - 1) / 6;
    printf("%s\n", sum == want ? "PASS" : "FAIL");
    return sum != want;
}
