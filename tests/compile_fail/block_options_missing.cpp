// expect: tessera::nn::Transformer<T, B, Block>: the block's options_type has no default value: give the model the block's options, Transformer(args, plan, options)
// expect: WidthOptions
// A block whose options have no default: a model made with them compiles (with_options),
// one made without them does not, and says what to give.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"

using namespace tessera;

struct WidthOptions {
  explicit WidthOptions(std::int64_t w) : width(w) {}
  std::int64_t width;
};

struct WideBlock {
  using scalar_type = float;
  using backend_type = Cpu;
  using options_type = WidthOptions;

  explicit WideBlock(const nn::BlockArgs<float, Cpu>& b)
      : scale_(b.name + ".scale", Shape{b.options<WidthOptions>().width}, nn::Init::ones()) {}
  Tensor<float> forward(const nn::Context<float>&, const Tensor<float>& x) { return x; }
  Tensor<float> backward(const nn::Context<float>&, const Tensor<float>& dy) { return dy; }
  template <class F>
  void for_each_parameter(F&& f) {
    f(scale_);
  }

 private:
  nn::Parameter<float> scale_;
};

void with_options(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, WideBlock> model(args, {}, WidthOptions{8}); }
void without_options(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, WideBlock> model(args); }
