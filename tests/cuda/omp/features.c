/* More of GCC's OpenMP device runtime: a double reduction over teams, threads and SIMD lanes,
   the number of teams from the device, device printf through newlib, atomics from every
   thread, and a target data region whose two kernels keep the data on the device. */
#include <omp.h>
#include <stdio.h>

int main(void) {
    enum { N = 1000 };
    static double a[N];
    static int b[N];
    for (int i = 0; i < N; i++) a[i] = 0.5 * i;

    double sum = 0;
    int teams = 0;
#pragma omp target teams distribute parallel for simd map(to : a) map(tofrom : teams) reduction(+ : sum)
    for (int i = 0; i < N; i++) {
        sum += a[i] * a[i];
        if (i == 0) teams = omp_get_num_teams();
    }
    double want = 0;
    for (int i = 0; i < N; i++) want += a[i] * a[i];

    int on_device = 0;
#pragma omp target map(tofrom : on_device)
    {
        on_device = !omp_is_initial_device();
        printf("hello from the device, team %d\n", omp_get_team_num());
    }

    int counter = 0;
#pragma omp target teams distribute parallel for map(tofrom : counter)
    for (int i = 0; i < N; i++) {
#pragma omp atomic
        counter += i % 3;
    }
    int want_counter = 0;
    for (int i = 0; i < N; i++) want_counter += i % 3;

#pragma omp target data map(from : b)
    {
#pragma omp target teams distribute parallel for
        for (int i = 0; i < N; i++) b[i] = i * 2;
#pragma omp target teams distribute parallel for
        for (int i = 0; i < N; i++) b[i] += 1;
    }
    int ok_b = 1;
    for (int i = 0; i < N; i++) ok_b &= b[i] == 2 * i + 1;

    int ok = sum == want && teams >= 1 && on_device && counter == want_counter && ok_b;
    printf("sum %.2f (want %.2f), teams %d, on device %d, counter %d (want %d), data %d\n", sum,
           want, teams, on_device, counter, want_counter, ok_b);
    printf("%s\n", ok ? "PASS" : "FAIL");
    return !ok;
}
