// LayerNorm/RmsNorm and cross-entropy kernels of src/kernels/layers.cu on
// the CPU (see shim.h), against double-precision references: grids capped
// so that grid-stride loops run, the weight and bias gradients' chunked
// sums as layers.rs launches them, ignore index, u32 and i64 targets, and
// NaN where PyTorch gives NaN. Exits non-zero on any failure.
#include "shim.h"
#include "layers.cu"
#include <cstdio>
#include <random>
#include <algorithm>
double norm_test(long long rows,int n,int remove_mean,int has_bias,bool want_dx,unsigned seed){
  std::mt19937 rng(seed); std::normal_distribution<float> nd(0,1);
  std::vector<float> x(rows*n),w(n),b(n),g(rows*n),y(rows*n,9),dx(rows*n,9),dw(n,9),db(n,9);
  for(auto&v:x)v=nd(rng)*2+1; for(auto&v:w)v=nd(rng); for(auto&v:b)v=nd(rng); for(auto&v:g)v=nd(rng);
  float eps=1e-5f; unsigned cap=4; // small cap to exercise grid-stride
  launch({std::min<unsigned>((rows+7)/8,cap),1,1},{256,1,1},[&]{norm_forward<float>(x.data(),w.data(),b.data(),has_bias,y.data(),rows,n,eps,remove_mean);});
  // chunking as layers.rs
  long long chunks=std::clamp<long long>((rows+127)/128,1,512); long long rpc=(rows+chunks-1)/chunks; chunks=(rows+rpc-1)/rpc;
  std::vector<float> stats(2*rows), partial(2*chunks*n);
  launch({std::min<unsigned>((rows+7)/8,cap),1,1},{256,1,1},[&]{norm_backward_rows<float>(x.data(),w.data(),g.data(),dx.data(),stats.data(),rows,n,eps,remove_mean,want_dx);});
  launch({(unsigned)((n+31)/32),(unsigned)chunks,1},{32,8,1},[&]{norm_backward_columns<float>(x.data(),g.data(),stats.data(),partial.data(),rows,n,rpc);});
  launch({std::min<unsigned>((n+255)/256,cap),1,1},{256,1,1},[&]{norm_backward_finish<float>(partial.data(),dw.data(),db.data(),n,(int)chunks);});
  double err=0; std::vector<double> rdw(n,0),rdb(n,0);
  for(long long r=0;r<rows;r++){ double mean=0; if(remove_mean){for(int j=0;j<n;j++)mean+=x[r*n+j]; mean/=n;} double var=0; for(int j=0;j<n;j++){double c=x[r*n+j]-mean; var+=c*c;} var/=n; double rstd=1/sqrt(var+eps);
    double sg=0,sgx=0; for(int j=0;j<n;j++){double xh=(x[r*n+j]-mean)*rstd; double yy=xh*w[j]+(has_bias?b[j]:0); err=std::max(err,fabs(yy-y[r*n+j])); double gh=g[r*n+j]*w[j]; sg+=gh; sgx+=gh*xh; rdw[j]+=g[r*n+j]*xh; rdb[j]+=g[r*n+j];}
    if(want_dx) for(int j=0;j<n;j++){double xh=(x[r*n+j]-mean)*rstd; double gh=g[r*n+j]*w[j]; double d=rstd*(gh-(remove_mean?sg/n:0)-xh*sgx/n); err=std::max(err,fabs(d-dx[r*n+j]));}}
  for(int j=0;j<n;j++){err=std::max(err,fabs(rdw[j]-dw[j])/std::max(1.0,fabs(rdw[j]))); err=std::max(err,fabs(rdb[j]-db[j])/std::max(1.0,fabs(rdb[j])));}
  return err;
}
template<class I> double ce_test(long long rows,long long V,int has_ignore,long long ig,std::vector<I> tg,unsigned seed,float*lossout=nullptr,bool nan_logit=false){
  std::mt19937 rng(seed); std::normal_distribution<float> nd(0,1);
  std::vector<float> lg(rows*V),saved(rows+1,-7),dl(rows*V,9),loss(1,-7),grad(1,0.7f);
  for(auto&v:lg)v=nd(rng)*3; if(nan_logit) lg[1]=NAN;
  launch({std::min<unsigned>(rows,3),1,1},{256,1,1},[&]{cross_entropy_lse<float>(lg.data(),saved.data(),rows,V);});
  launch({1,1,1},{256,1,1},[&]{cross_entropy_loss<float,I>(lg.data(),tg.data(),saved.data(),loss.data(),rows,V,has_ignore,ig);});
  launch({std::min<unsigned>(rows,3),1,1},{256,1,1},[&]{cross_entropy_backward<float,I>(lg.data(),tg.data(),saved.data(),grad.data(),dl.data(),rows,V,has_ignore,ig);});
  if(lossout)*lossout=loss[0];
  double tot=0; long long cnt=0; double err=0; std::vector<double> lse(rows);
  for(long long r=0;r<rows;r++){double m=-1e300; for(long long v=0;v<V;v++)m=std::max(m,(double)lg[r*V+v]); double s=0; for(long long v=0;v<V;v++)s+=exp(lg[r*V+v]-m); lse[r]=m+log(s); err=std::max(err,fabs(lse[r]-saved[r]));
    long long t=(long long)tg[r]; if(has_ignore&&t==ig)continue; cnt++; tot+=lse[r]-lg[r*V+t];}
  err=std::max(err,fabs((double)cnt-saved[rows])); err=std::max(err,fabs(tot/cnt-loss[0]));
  for(long long r=0;r<rows;r++){long long t=(long long)tg[r]; bool c=!(has_ignore&&t==ig); for(long long v=0;v<V;v++){double d=c?0.7/cnt*(exp(lg[r*V+v]-lse[r])-(v==t)):0; err=std::max(err,fabs(d-dl[r*V+v]));}}
  return err;
}
static int failures = 0;

static void expect(bool ok, const char* what) {
    if (!ok) {
        printf("FAIL %s\n", what);
        failures++;
    }
}

int main() {
    char what[160];
    for (long long rows : {1LL, 7LL, 33LL, 300LL})
        for (int n : {1, 5, 32, 33, 100})
            for (int rm : {0, 1})
                for (int hb : {0, 1}) {
                    double e = norm_test(rows, n, rm, hb, (rows + n) % 2 == 0, rows * n + rm);
                    snprintf(what, sizeof what, "norm rows %lld, n %d, remove_mean %d, bias %d: error %g",
                             rows, n, rm, hb, e);
                    expect(e <= 1e-4, what);
                }
    for (long long V : {1LL, 3LL, 256LL, 300LL, 1000LL}) {
        long long rows = 5;
        std::vector<long long> t = {0, V - 1, -100, V / 2, 0};
        std::vector<unsigned> tu = {0, (unsigned)(V - 1), 1u % (unsigned)V, (unsigned)(V / 2), 0};
        double e = std::max({ce_test<long long>(rows, V, 1, -100, t, V),
                             ce_test<unsigned>(rows, V, 1, -100, tu, V + 1),
                             ce_test<unsigned>(rows, V, 0, 0, tu, V + 2)});
        snprintf(what, sizeof what, "cross-entropy vocab %lld: error %g", V, e);
        expect(e <= 1e-5, what);
    }
    float loss;
    std::vector<long long> all = {-100, -100};
    ce_test<long long>(2, 10, 1, -100, all, 1, &loss);
    expect(std::isnan(loss), "cross-entropy with every row ignored is NaN");
    std::vector<long long> out_of_range = {0, 10};
    ce_test<long long>(2, 10, 1, -100, out_of_range, 1, &loss);
    expect(std::isnan(loss), "cross-entropy with a target out of range is NaN");
    std::vector<long long> fine = {0, 3};
    ce_test<long long>(2, 10, 1, -100, fine, 1, &loss, true);
    expect(std::isnan(loss), "cross-entropy with a NaN logit is NaN");
    printf("norms and cross-entropy on the CPU: %s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
